"""TTT loss: the alignment of docs/architecture.md, Training-time test, against a per-row loop; masking, frozen
params, chunking."""

import math

import pytest
import torch

from fledge.models.alignment import ttt_states
from fledge.run_layout import RunLayout
from fledge.train.losses import ttt_loss
from tests.helpers.models import FLAGS, make_drafter, packed_batch

K, W = 3, 0.8


def naive_metrics(d, b, head, steps):
    """Per-row loops written from docs/architecture.md, Training-time test, independent of train/losses'
    vectorised masks."""
    with torch.no_grad():
        logits = [d.lm_head(y) for y in ttt_states(d, b, steps)]
    B, T = b.input_ids.shape
    out = {}
    chain = {}
    for k in range(steps):
        loss = n = right = scored_n = 0.0
        for r in range(B):
            for t in range(T):
                p, tp = t + 2 + k, t + 1 + k  # predicted token x_{t+2+k}; teacher state at t+1+k
                doc = int(b.document_ids[r, t])
                scored = doc >= 0 and p < T and int(b.document_ids[r, p]) == doc and bool(b.loss_mask[r, p])
                prev = chain.get((r, t), (True, True))
                chain[(r, t)] = (prev[0] and scored, prev[1])
                if not scored:
                    continue
                scored_n += 1
                # a teacher argmax outside the draft vocab: a miss the drafter cannot avoid, not a loss row
                hit = int(d.draft_to_target(logits[k][r, t].argmax())) == int(b.target_argmax[r, tp])
                right += hit
                chain[(r, t)] = (prev[0], prev[1] and hit)
                if not bool(d.t2d[b.target_argmax[r, tp]]):
                    continue
                teacher = torch.softmax(b.target_hidden[r, tp] @ head.T, -1)
                loss += float(-(teacher * torch.log_softmax(logits[k][r, t], -1)).sum())
                n += 1
        full = [c[0] and c[1] for c in chain.values()]
        out[k] = dict(loss=(loss, n), acc=(right, scored_n), full=(sum(full), sum(c[0] for c in chain.values())))
    return out


def remapped(d):
    """A non-identity draft vocab, so some teacher argmaxes fall outside it."""
    sel = torch.arange(50)[torch.arange(50) % 5 != 0]  # 40 ids; multiples of 5 are outside
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[sel] = True
    d.set_vocab(sel - torch.arange(40), t2d)
    return d


@pytest.mark.parametrize("flags", ["eagle3", "eagle31"])
def test_alignment_matches_per_row_loop(flags):
    d = remapped(make_drafter(**FLAGS[flags]))
    b = packed_batch()
    b.target_argmax = torch.randint(0, 50, b.target_argmax.shape, generator=torch.Generator().manual_seed(3))
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        res = ttt_loss(d, b, head, steps=K, step_weight=W, chunk_size=4)
    want = naive_metrics(d, b, head, K)
    total = 0.0
    for k in range(K):
        num, den = res.metrics[f"loss_{k}"]
        assert float(den) == want[k]["loss"][1] > 0
        assert math.isclose(float(num), want[k]["loss"][0], rel_tol=1e-5)
        assert (float(res.metrics[f"acc_{k}"][0]), float(res.metrics[f"acc_{k}"][1])) == want[k]["acc"]
        assert tuple(float(x) for x in res.metrics[f"full_acc_{k}"]) == want[k]["full"]
        total += W**k * want[k]["loss"][0] / want[k]["loss"][1]
    assert math.isclose(float(res.loss), total, rel_tol=1e-5)
    # out-of-draft-vocab teachers are really dropped from the loss, and really misses in the accuracies
    assert float(res.metrics["loss_0"][1]) < float(res.metrics["acc_0"][1]) < int(b.loss_mask.sum())


def test_some_predictions_are_right():
    """acc counts hits: make the drafter's head equal to the teacher head on y == target_hidden."""
    d = make_drafter()
    b = packed_batch()
    head = d.lm_head.weight.detach().clone()
    with torch.no_grad():
        y0 = ttt_states(d, b, 1)[0]
        b.target_hidden = torch.roll(y0, 1, dims=1)  # teacher at t+1 == drafter state at t
        b.target_argmax = d.draft_to_target(d.lm_head(b.target_hidden).argmax(-1))
        res = ttt_loss(d, b, head, steps=1, step_weight=W, chunk_size=5)
    num, den = res.metrics["acc_0"]
    assert den > 0 and num == den


def test_grads_only_on_trainable_and_chunking_invariant():
    d = make_drafter()
    d.train()
    b = packed_batch()
    head = torch.randn(40, 32)
    grads = []
    for chunk in (3, 1000):
        d.zero_grad(set_to_none=True)
        res = ttt_loss(d, b, head, steps=K, step_weight=W, chunk_size=chunk)
        res.loss.backward()
        assert d.embed_tokens.weight.grad is None and not d.embed_tokens.weight.requires_grad
        missing = [n for n, p in d.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
        assert missing == []
        grads.append({n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)


def test_sdpa_and_dense_paths_agree():
    b = packed_batch()
    head = torch.randn(40, 32)
    out = {}
    for impl in ("sdpa", "dense"):
        d = make_drafter(attention=impl)
        res = ttt_loss(d, b, head, steps=K, step_weight=W, chunk_size=8)
        res.loss.backward()
        out[impl] = (res.loss.detach(), {n: p.grad for n, p in d.named_parameters() if p.grad is not None})
    torch.testing.assert_close(out["sdpa"][0], out["dense"][0])
    for n, g in out["dense"][1].items():
        torch.testing.assert_close(out["sdpa"][1][n], g, atol=1e-5, rtol=1e-4)


def test_all_masked_rows_give_finite_zero_loss():
    d = make_drafter()
    b = packed_batch()
    b.loss_mask[:] = False
    res = ttt_loss(d, b, torch.randn(40, 32), steps=K, step_weight=W, chunk_size=8)
    assert torch.isfinite(res.loss) and float(res.loss.detach()) == 0.0
    res.loss.backward()
    assert all(float(res.metrics[f"acc_{k}"][1]) == 0 for k in range(K))
    # lm_head stays in the graph (a zero gradient, not None): every rank must reduce the same buckets
    assert d.lm_head.weight.grad is not None and not d.lm_head.weight.grad.any()


def test_bad_arguments():
    d = make_drafter()
    b = packed_batch()
    with pytest.raises(ValueError, match="ttt_steps"):
        ttt_loss(d, b, torch.randn(40, 32), steps=0, step_weight=W, chunk_size=8)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        ttt_loss(d, b, torch.randn(41, 32), steps=1, step_weight=W, chunk_size=8)


def summation_rtol(n_terms: int) -> float:
    """How far apart two fp32 sums of the same ``n_terms`` non-negative terms may be, relative to the sum,
    when they add them in different orders: each order is within (n - 1) u of the exact sum (u = 2^-24, the
    recursive-summation bound), so the two within 2 (n - 1) u. It holds whatever order a CPU's kernels pick
    (AVX2, AVX-512 and AMX builds do pick differently)."""
    return 2 * (n_terms - 1) * 2.0**-24


def test_zero3_path_equals_the_shared_teacher_path(monkeypatch):
    """Under ZeRO-3 the loss goes step by step through lm_head's forward (teacher per step); elsewhere the
    teacher is computed once for all steps. Same loss, metrics and gradients: the summed losses agree to the
    bound of summing their rows x Vd products in another order (one CPU's kernels were 1.1e-7 apart where a
    fixed 1e-7 was allowed), the counts exactly."""
    import fledge.train.losses.paths as L

    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    out = {}
    for partitioned in (False, True):
        monkeypatch.setattr(L, "partitioned", lambda lm_head, partitioned=partitioned: partitioned)
        d = remapped(make_drafter(**FLAGS["eagle31"]))
        d.train()
        b = packed_batch()
        b.target_argmax = torch.randint(0, 50, b.target_argmax.shape, generator=torch.Generator().manual_seed(3))
        res = ttt_loss(d, b, head, steps=K, step_weight=W, chunk_size=5)
        res.loss.backward()
        out[partitioned] = (res, {n: p.grad for n, p in d.named_parameters() if p.grad is not None})
    (a, ga), (b_, gb) = out[False], out[True]
    vd = head.shape[0]
    rows = sum(int(a.metrics[f"loss_{k}"][1]) for k in range(K))
    assert math.isclose(float(a.loss), float(b_.loss), rel_tol=summation_rtol(rows * vd))
    for name in a.metrics:
        assert torch.equal(a.metrics[name][1], b_.metrics[name][1])
        if name.startswith("loss_"):  # a sum of fp32 products, in another order on each path
            n = int(a.metrics[name][1]) * vd
            assert math.isclose(float(a.metrics[name][0]), float(b_.metrics[name][0]), rel_tol=summation_rtol(n)), name
        else:  # counts of right rows: exact
            assert torch.equal(a.metrics[name][0], b_.metrics[name][0]), name
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-6, rtol=1e-5)


def _two_micro_batches():
    """A two-row batch and its rows as two micro-batches, one with few counted rows and one with many."""
    from dataclasses import fields

    from fledge.data.features.batch import FeatureBatch

    whole = packed_batch()
    whole.target_argmax = torch.randint(0, 50, whole.target_argmax.shape, generator=torch.Generator().manual_seed(3))
    whole.loss_mask[0] &= torch.arange(whole.loss_mask.shape[1]) % 4 == 0  # row 0: a few masked tokens
    whole.loss_mask[1] = True
    parts = [FeatureBatch(**{f.name: getattr(whole, f.name)[r:r + 1] for f in fields(whole)}) for r in (0, 1)]
    return whole, parts


@pytest.mark.parametrize("name", ["ttt_ce", "lk_lambda", "tv"])
@pytest.mark.parametrize("partitioned", [False, True])
def test_two_micro_batches_train_like_one_batch_holding_both(monkeypatch, partitioned, name):
    """One rank, grad_accum=2: with the step's denominators (train/losses step_denominators, divisor 2)
    and each micro-batch's gradient halved (what DeepSpeed's backward does; tests/distributed/
    test_accumulation.py runs the engine itself), the loss and every gradient are those of one batch holding
    both micro-batches' rows, in fp32 to rounding. The micro-batches' own means (the old normalisation) are
    far from it: their rows weigh 1/n of their own micro-batch, not of the step. It holds for every loss
    (the counted rows and the denominators are shared code), the LK hybrid included: its KL weight is per row,
    not per micro-batch."""
    import fledge.train.losses.paths as L
    from fledge.train.losses import LOSSES, step_denominators

    monkeypatch.setattr(L, "partitioned", lambda lm_head: partitioned)  # both execution paths
    loss = LOSSES.get(name)(steps=K, step_weight=W, chunk_size=5)
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    whole, parts = _two_micro_batches()

    def run(batches, denominators):
        d = remapped(make_drafter(**FLAGS["eagle31"])).train()
        total = 0.0
        for b in batches:
            res = loss(d, b, head, denominators=denominators)
            (res.loss / len(batches)).backward()
            total += float(res.loss.detach()) / len(batches)
        return total, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}

    d = remapped(make_drafter(**FLAGS["eagle31"]))
    counts = [loss.counted_rows(d, b) for b in parts]
    assert int(counts[1].min()) > 3 * int(counts[0].max()) > 0  # very different micro-batches
    one, g_one = run([whole], None)
    two, g_two = run(parts, step_denominators(counts[0] + counts[1], 2))
    own, g_own = run(parts, None)
    assert two == pytest.approx(one, rel=1e-6)
    assert g_one.keys() == g_two.keys() and len(g_one) > 5
    for n in g_one:
        torch.testing.assert_close(g_two[n], g_one[n], rtol=1e-5, atol=1e-7)
    assert abs(own - one) > 0.01 * one  # the control: a micro-batch's own mean is another objective
    assert max(float((g_own[n] - g_one[n]).norm() / g_one[n].norm()) for n in g_one) > 0.05


def test_bf16_gradients_stay_accurate_near_convergence():
    """bf16 drafter close to its teacher (W_d ~ W_t, y ~ t; drafter-teacher KL ~0.004): the shared-teacher
    path's gradients (torch path) against fp64 math stay within 1.5x of the standard error (fp32 math, the
    gradient rounded to bf16 once, ~0.17%). Rounding softmax(b) W and p W to bf16 before subtracting (and
    bf16 logits) gave 25% (dy) and 33% (dW) here; the Triton kernel's check is in test_kernels_interpret.py."""
    from tests.helpers.loss_precision import near_converged, reference_grads, rel_err, shared_teacher_grads

    problem = near_converged(n=384, h=128, vd=1000, steps=3, eps=0.03)
    want_dy, want_dw, kl = reference_grads(problem, torch.float64)
    std_dy, std_dw, _ = reference_grads(problem, torch.float32)
    got_dy, got_dw = shared_teacher_grads(problem, "chunked", chunk_size=100)
    assert kl < 0.01, f"not near convergence: KL {kl:.4f}"
    for name, got, std, want in (("dy", got_dy, std_dy, want_dy), ("dW", got_dw, std_dw, want_dw)):
        err, bound = rel_err(got, want), 1.5 * rel_err(std, want)
        assert err <= bound, f"{name}: relative error {err:.3%} vs fp64, standard {bound / 1.5:.3%}"


# ---- the loss registry: a new loss is one class, selected by drafter.loss -------------------------------------


@pytest.fixture
def double_ce():
    """A toy loss registered as ``double_ce``: twice the soft CE, written once as loss_sum (so it runs through
    the generic path on every ZeRO stage), unregistered afterwards."""
    import torch.nn.functional as F

    from fledge.train.losses import LOSSES, TTTLoss

    class DoubleCE(TTTLoss):
        name = "double_ce"

        def loss_sum(self, logits, teacher_logits):
            return -2 * (F.softmax(teacher_logits, -1) * F.log_softmax(logits, -1)).sum()

    with LOSSES.temporary("double_ce", DoubleCE):
        yield DoubleCE


def _batch_for(spec, T=24, seed=5):
    """A one-row FeatureBatch (two packed documents) shaped for a drafter with ``spec``."""
    from fledge.data.features.batch import FeatureBatch

    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * (T // 2) + [1] * (T // 2)], dtype=torch.int32)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T // 2)])[None]
    Ht, n = spec.target_hidden_size, len(spec.aux_layer_ids)
    return FeatureBatch(input_ids=torch.randint(0, spec.vocab_size, (1, T), generator=g),
                        loss_mask=torch.ones(1, T, dtype=torch.bool), aux_hidden=torch.randn(1, T, n * Ht, generator=g),
                        target_hidden=torch.randn(1, T, Ht, generator=g),
                        target_argmax=torch.randint(0, spec.vocab_size, (1, T), generator=g),
                        position_ids=pos, document_ids=doc)


def test_a_registered_loss_is_what_the_trainer_builds_and_runs(double_ce, random_tiny_target, tmp_path):
    """drafter.loss=double_ce through build_ttt_model (what run_training calls): the model holds the toy loss,
    and its loss and every gradient are twice those of the default ttt_ce."""
    from fledge.conf import compose
    from fledge.data.prepare.vocab import DraftVocab
    from fledge.pipeline.stages import train_inputs
    from fledge.train.ttt_model import build_ttt_model

    counts = torch.randint(0, 100, (2560,), generator=torch.Generator().manual_seed(0))
    DraftVocab.build(counts, 512).save(RunLayout(tmp_path).prepare.vocab)
    base = ["recipe=tiny", f"target.name_or_path={random_tiny_target}", "drafter.draft_vocab_size=512",
            "drafter.loss_chunk_size=7"]
    out = {}
    for name in ("ttt_ce", "double_ce"):
        inputs = train_inputs(compose([*base, f"drafter.loss={name}"]))
        model = build_ttt_model(inputs, RunLayout(tmp_path).prepare.vocab, torch.device("cpu"))
        assert model.loss.name == name
        res = model(_batch_for(model.drafter.spec))
        res.loss.backward()
        out[name] = (res, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (ce, g_ce), (dbl, g_dbl) = out["ttt_ce"], out["double_ce"]
    assert isinstance(model.loss, double_ce) and float(ce.metrics["loss_0"][1]) > 0
    torch.testing.assert_close(dbl.loss, 2 * ce.loss)
    assert g_ce.keys() == g_dbl.keys() and len(g_ce) > 5
    for n in g_ce:
        torch.testing.assert_close(g_dbl[n], 2 * g_ce[n], atol=1e-6, rtol=1e-4)


def test_the_shared_teacher_path_is_only_for_the_formula_it_rewrites():
    """A subclass of the soft CE that changes loss_sum must not inherit the CE-only fast path."""
    from fledge.train.losses import SoftCrossEntropy

    class Scaled(SoftCrossEntropy):
        def loss_sum(self, logits, teacher_logits):
            return 3 * super().loss_sum(logits, teacher_logits)

    d, b, head = make_drafter(), packed_batch(), torch.randn(40, 32)
    with torch.no_grad():
        ce = SoftCrossEntropy(steps=K, step_weight=W, chunk_size=8)(d, b, head)
        scaled = Scaled(steps=K, step_weight=W, chunk_size=8)(d, b, head)
    torch.testing.assert_close(scaled.loss, 3 * ce.loss)


def test_unknown_loss_names_the_key_and_the_choices():
    from fledge.conf import compose
    from fledge.pipeline.preflight import check_config
    from fledge.train.losses import LOSSES, build_loss

    with pytest.raises(ValueError, match=r"drafter\.loss='nope': expected one of \[.*'ttt_ce'.*train/losses"):
        LOSSES.check("nope")
    cfg = compose(["recipe=tiny", "drafter.loss=nope"])  # the schema cannot see the registry ...
    with pytest.raises(ValueError, match=r"drafter\.loss='nope'"):
        check_config(cfg)  # ... every entry point refuses it before any work (pipeline/preflight.py)
    with pytest.raises(ValueError, match=r"drafter\.loss='nope'"):
        build_loss(cfg.drafter)
    assert build_loss(compose(["recipe=tiny"]).drafter).name == "ttt_ce"
