"""The registered losses besides the soft CE (train/losses, train/losses/divergences.py): each against an fp64
reference of its value and gradient written here from its definition, on both execution paths (ZeRO-3's
generic path and the fp32-head path used elsewhere), in bf16 near convergence, the memory rule, the mix
and the config keys."""

import math

import pytest
import torch

from fledge.models.alignment import StepRows
from tests.helpers.memory import saved_bytes
from tests.helpers.models import FLAGS, make_drafter, packed_batch

K, W = 3, 0.8
BETA, ETA = 0.3, 2.0
MIX = {"ttt_ce": 0.25, "tv": 2.0, "rkl": 0.5}
NAMES = ("ttt_ce", "rkl", "jsd", "tv", "lk_lambda", "lk_alpha", "mix")


# ---- fp64 references, from the definitions (not from train/losses/divergences.py) ---------------------------------
def _probs(x):
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def _kl(p, q):
    return (p * torch.log(p / q)).sum(-1)


def ref_rows(name, b, a):
    """The per-row loss ``name`` of drafter logits b and teacher logits a, in their dtype (fp64 here)."""
    p, q = _probs(a), _probs(b)
    alpha = torch.minimum(p, q).sum(-1)
    if name == "ttt_ce":
        return -(p * torch.log(q)).sum(-1)
    if name == "rkl":
        return _kl(q, p)
    if name == "jsd":
        m = BETA * p + (1 - BETA) * q
        return BETA * _kl(p, m) + (1 - BETA) * _kl(q, m)
    if name == "tv":
        return 1 - alpha
    if name == "lk_lambda":
        lam = torch.exp(-ETA * alpha.detach())
        return lam * _kl(p, q) + (1 - lam) * (1 - alpha)
    if name == "lk_alpha":
        return -torch.log(alpha.clamp_min(1e-5))
    assert name == "mix"
    return sum(w * ref_rows(n, b, a) for n, w in MIX.items())


def make_loss(name, chunk_size=5):
    from fledge.train.losses import LOSSES, Mix

    base = dict(steps=K, step_weight=W, chunk_size=chunk_size)
    if name == "mix":
        return Mix(weights=MIX, options={"jsd_beta": BETA, "lk_eta": ETA}, **base)
    extra = {"jsd": {"jsd_beta": BETA}, "lk_lambda": {"lk_eta": ETA}}.get(name, {})
    return LOSSES.get(name)(**base, **extra)


def _logits(rows=24, vd=70, seed=0):
    """Drafter and teacher logits, half the rows close to each other (where the losses differ most)."""
    g = torch.Generator().manual_seed(seed)
    a = 2 * torch.randn(rows, vd, generator=g, dtype=torch.float64)
    b = 2 * torch.randn(rows, vd, generator=g, dtype=torch.float64)
    b[::2] = a[::2] + 0.1 * torch.randn(rows // 2, vd, generator=g, dtype=torch.float64)
    return b, a


@pytest.mark.parametrize("name", NAMES)
def test_each_formula_matches_its_fp64_definition(name):
    """loss_sum in fp32 against the fp64 definition: value and gradient in the drafter's logits."""
    b64, a64 = _logits()
    want_b = b64.clone().requires_grad_()
    want = ref_rows(name, want_b, a64).sum()
    want.backward()
    got_b = b64.float().requires_grad_()
    got = make_loss(name).loss_sum(got_b, a64.float())
    got.backward()
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6)
    torch.testing.assert_close(got_b.grad.double(), want_b.grad, rtol=1e-4, atol=1e-7)
    if name not in ("ttt_ce", "mix"):  # a divergence: 0 where the drafter is the teacher (not so the CE)
        assert abs(float(make_loss(name).loss_sum(a64.float(), a64.float()))) < 1e-4


def test_total_variation_is_the_rejection_rate_of_speculative_sampling():
    """1 - TV = P(accept) = sum_v q_v min(1, p_v / q_v): a token drawn from q is kept with min(1, p/q)."""
    from fledge.train.losses.divergences import tv_rows

    b, a = _logits()
    p, q = _probs(a), _probs(b)
    accept = (q * torch.clamp(p / q, max=1.0)).sum(-1)
    torch.testing.assert_close(1 - tv_rows(b, a), accept)


# ---- both execution paths against the fp64 reference -------------------------------------------------------
def _path_problem(n=30, h=16, ht=12, vd=50, seed=3, dtype=torch.float32):
    """K step states [n + K, H] over one teacher state [n + K, Ht] (step k scores row r against r + 1 + k),
    some rows not counted, and the two heads."""
    g = torch.Generator().manual_seed(seed)
    m = n + K
    t = torch.randn(m, ht, generator=g)
    ys = [torch.randn(m, h, generator=g) for _ in range(K)]
    w_d, w_t = torch.randn(vd, h, generator=g) / h**0.5, torch.randn(vd, ht, generator=g) * 2 / ht**0.5
    rows = []
    for k in range(K):
        counted = (torch.arange(m) < n) & (torch.rand(m, generator=g) > 0.2)
        rows.append(StepRows(lead=1 + k, teacher_argmax=torch.zeros(m, dtype=torch.long), counted=counted,
                             scored=counted))
    return dict(ys=[y.to(dtype) for y in ys], t=t.to(dtype), w_d=w_d.to(dtype), w_t=w_t.to(dtype), rows=rows)


def _run_path(path, loss_sum, prob, chunk_size=7):
    import fledge.train.losses.paths as L

    ys = [y.clone().requires_grad_() for y in prob["ys"]]
    head = torch.nn.Linear(prob["w_d"].shape[1], prob["w_d"].shape[0], bias=False, dtype=prob["w_d"].dtype)
    with torch.no_grad():
        head.weight.copy_(prob["w_d"])
    run = {"generic": L.per_step_module_calls, "fp32_head": L.fp32_head_steps}[path]
    parts = run(loss_sum, ys, prob["rows"], prob["t"], head, prob["w_t"], chunk_size)
    total = sum(W**k * s / int(r.counted.sum()) for k, ((s, _, _), r) in enumerate(zip(parts, prob["rows"])))
    total.backward()
    return total.detach(), [y.grad for y in ys], head.weight.grad, [pred for _, _, pred in parts]


def _reference(name, prob):
    ys = [y.double().requires_grad_() for y in prob["ys"]]
    w_d = prob["w_d"].double().requires_grad_()
    a = prob["t"].double() @ prob["w_t"].double().T
    total, preds = 0.0, []
    for k, (y, s) in enumerate(zip(ys, prob["rows"])):
        r = s.counted.nonzero().squeeze(1)
        b = y[r] @ w_d.T
        total = total + W**k * ref_rows(name, b, a[r + s.lead]).sum() / r.numel()
        preds.append(b.detach().argmax(-1))
    total.backward()
    return total.detach(), [y.grad for y in ys], w_d.grad, preds


@pytest.mark.parametrize("path", ["generic", "fp32_head"])
@pytest.mark.parametrize("name", NAMES)
def test_each_loss_on_each_path_matches_fp64(name, path):
    """The TTT loss of K steps (each step's sum over its counted rows / their count, weighted w^k) and its
    gradients in every step's states and in lm_head, in fp32 on ZeRO-3's path and on the path used elsewhere,
    against the fp64 reference; and the drafter's argmax rows."""
    prob = _path_problem()
    got, dys, dw, preds = _run_path(path, make_loss(name).loss_sum, prob)
    want, want_dys, want_dw, want_preds = _reference(name, prob)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for k in range(K):
        torch.testing.assert_close(dys[k].double(), want_dys[k], rtol=1e-4, atol=1e-6)
        assert torch.equal(preds[k], want_preds[k])
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-4, atol=1e-6)


def test_the_steps_share_each_chunk_of_teacher_logits(monkeypatch):
    """The fp32-head path computes a chunk of teacher rows' logits once for all K steps (forward, and again in
    backward), not once per step: its teacher GEMMs number twice the chunks of the teacher rows read."""
    import fledge.models.kernels.head_loss as H

    prob = _path_problem()
    ht = prob["t"].shape[1]
    calls = []

    def counting(a, b, low):
        calls.append(b.shape[0] == ht)  # b is W_t^T [Ht, Vd] for the teacher, W_d^T [H, Vd] for a step
        return mm_f32(a, b, low)

    mm_f32 = H.mm_f32
    monkeypatch.setattr(H, "mm_f32", counting)
    _run_path("fp32_head", make_loss("tv").loss_sum, prob, chunk_size=7)
    wanted = torch.unique(torch.cat([s.counted.nonzero().squeeze(1) + s.lead for s in prob["rows"]])).numel()
    assert sum(calls) == 2 * math.ceil(wanted / 7)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_gradients_near_convergence(name):
    """bf16, drafter close to its teacher (KL ~0.004): the fp32-head path's gradients within 1.5x of the
    standard error against fp64 (fp32 math, rounded to bf16 once); ZeRO-3's generic path, whose logits come
    out of lm_head's bf16 forward and whose lm_head gradient is summed in bf16, is the control: far worse
    (24% / 32% off for the soft CE), which is why the fp32-head path exists."""
    from tests.helpers.loss_precision import near_converged, path_grads, reference_grads, rel_err

    problem = near_converged(n=192, h=64, vd=500, steps=K, eps=0.03)
    loss = make_loss(name)
    want_dy, want_dw, kl = reference_grads(problem, torch.float64, lambda b, a: ref_rows(name, b, a).sum())
    std_dy, std_dw, _ = reference_grads(problem, torch.float32, loss.loss_sum)
    assert kl < 0.01, f"not near convergence: KL {kl:.4f}"
    got = dict(zip(("dy", "dW"), path_grads(problem, "fp32_head", loss.loss_sum, chunk_size=50)))
    generic = dict(zip(("dy", "dW"), path_grads(problem, "generic", loss.loss_sum, chunk_size=50)))
    for key, std, want in (("dy", std_dy, want_dy), ("dW", std_dw, want_dw)):
        err, bound = rel_err(got[key], want), 1.5 * rel_err(std, want)
        assert err <= bound, f"{key}: relative error {err:.3%} vs fp64, standard {bound / 1.5:.3%}"
        assert rel_err(generic[key], want) > 5 * bound, key


# ---- the memory rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["generic", "fp32_head", "materialised"])
@pytest.mark.parametrize("name", ["tv", "lk_lambda", "mix"])
def test_no_step_keeps_its_logits_for_backward(name, path):
    """What the loss keeps for backward does not grow with Vd on either path: each chunk's logits are
    recomputed in backward, never kept (the materialised path, plain autograd over every step's logits, is the
    negative control: it keeps [rows, Vd] tensors for every step)."""
    import fledge.train.losses.paths as L

    saved = {}
    for vd in (50, 500):
        prob = _path_problem(vd=vd)
        ys = [y.clone().requires_grad_() for y in prob["ys"]]
        head = torch.nn.Linear(prob["w_d"].shape[1], vd, bias=False)
        loss_sum = make_loss(name).loss_sum

        def materialised(*args, ys=ys, prob=prob, loss_sum=loss_sum, head=head):
            out = []
            for y, s in zip(ys, prob["rows"]):
                r = s.counted.nonzero().squeeze(1)
                out.append((loss_sum(head(y[r]), prob["t"][r + s.lead] @ prob["w_t"].T), r, None))
            return out

        run = {"generic": L.per_step_module_calls, "fp32_head": L.fp32_head_steps,
               "materialised": materialised}[path]
        saved[vd] = saved_bytes(lambda run=run, loss_sum=loss_sum, ys=ys, prob=prob, head=head:
                                 run(loss_sum, ys, prob["rows"], prob["t"], head, prob["w_t"], 7),
                                 [*ys, prob["t"], prob["w_t"], head.weight])
    rows = sum(int(s.counted.sum()) for s in prob["rows"])
    one_step_of_logits = rows // K * (500 - 50) * 4  # fp32 bytes of one step's [rows, dVd] logits
    if path == "materialised":
        assert saved[500] - saved[50] > K * one_step_of_logits
    else:
        assert saved[500] - saved[50] < one_step_of_logits / 10, saved


# ---- through the drafter: both paths, the shared code ------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in NAMES if n != "ttt_ce"])  # ttt_ce: tests/unit/train/test_loss.py
def test_zero3_path_equals_the_path_used_elsewhere(monkeypatch, name):
    """A drafter's TTT loss under ZeRO-3 (generic path) and outside it (fp32-head path): same loss, metrics
    and gradients of every trainable parameter."""
    import fledge.train.losses.paths as L

    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    out = {}
    for partitioned in (False, True):
        monkeypatch.setattr(L, "partitioned", lambda lm_head, partitioned=partitioned: partitioned)
        d = make_drafter(**FLAGS["eagle31"]).train()
        b = packed_batch()
        res = make_loss(name)(d, b, head)
        res.loss.backward()
        out[partitioned] = (res, {n: p.grad for n, p in d.named_parameters() if p.grad is not None})
    (a, ga), (b_, gb) = out[False], out[True]
    assert float(a.loss.detach()) == pytest.approx(float(b_.loss.detach()), rel=1e-5)
    for key in a.metrics:
        assert torch.equal(a.metrics[key][1], b_.metrics[key][1]), key
        assert float(a.metrics[key][0]) == pytest.approx(float(b_.metrics[key][0]), rel=1e-5), key
    assert ga.keys() == gb.keys() and len(ga) > 5
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-6, rtol=1e-4)


def test_mix_is_the_weighted_sum_of_its_parts():
    """drafter.loss=mix: the loss, each step's logged loss and every gradient are the weighted sums of its
    parts' (each with its options)."""
    d, b, head = make_drafter().train(), packed_batch(), torch.randn(40, 32, generator=torch.Generator().manual_seed(2))

    def run(loss):
        d.zero_grad(set_to_none=True)
        res = loss(d, b, head)
        res.loss.backward()
        return res, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}

    mix, g_mix = run(make_loss("mix"))
    parts = {n: run(make_loss(n)) for n in MIX}
    assert float(mix.loss) == pytest.approx(sum(w * float(parts[n][0].loss) for n, w in MIX.items()), rel=1e-5)
    for k in range(K):
        want = sum(w * float(parts[n][0].metrics[f"loss_{k}"][0]) for n, w in MIX.items())
        assert float(mix.metrics[f"loss_{k}"][0]) == pytest.approx(want, rel=1e-5)
    for n in g_mix:
        torch.testing.assert_close(g_mix[n], sum(w * parts[p][1][n] for p, w in MIX.items()), atol=1e-6, rtol=1e-4)


# ---- config --------------------------------------------------------------------------------------------------
def test_every_loss_is_selectable_by_config_with_its_options():
    from fledge.conf import compose
    from fledge.train.losses import build_loss

    for name in ("rkl", "tv", "lk_alpha"):
        assert build_loss(compose(["recipe=tiny", f"drafter.loss={name}"]).drafter).name == name
    jsd = build_loss(compose(["recipe=tiny", "drafter.loss=jsd", "drafter.loss_options.jsd_beta=0.2"]).drafter)
    lk = build_loss(compose(["recipe=tiny", "drafter.loss=lk_lambda", "drafter.loss_options.lk_eta=1.5"]).drafter)
    assert (jsd.name, jsd.beta, lk.name, lk.eta) == ("jsd", 0.2, "lk_lambda", 1.5)
    mix = build_loss(compose(["recipe=tiny", "drafter.loss=mix", "+drafter.loss_mix={ttt_ce: 0.5, jsd: 0.5}",
                              "drafter.loss_options.jsd_beta=0.2"]).drafter)
    assert [(w, p.name) for w, p in mix.parts] == [(0.5, "ttt_ce"), (0.5, "jsd")] and mix.parts[1][1].beta == 0.2


@pytest.mark.parametrize("overrides, key", [
    (["drafter.loss=mix"], r"drafter\.loss=mix needs .* drafter\.loss_mix"),
    (["+drafter.loss_mix={tv: 1.0}"], r"drafter\.loss_mix=\{'tv': 1\.0\} is set but drafter\.loss=ttt_ce"),
    (["drafter.loss=mix", "+drafter.loss_mix={tv: -1.0}"], r"drafter\.loss_mix\.tv=-1\.0: must be >= 0"),
    (["drafter.loss=mix", "+drafter.loss_mix={tv: nan}"], r"drafter\.loss_mix\.tv=nan: must be finite and >= 0"),
    (["drafter.loss=mix", "+drafter.loss_mix={tv: 0.0}"], r"drafter\.loss_mix=.*not all 0"),
    (["drafter.loss=mix", "+drafter.loss_mix={mix: 1.0}"], r"drafter\.loss_mix=.*'mix' cannot be a part"),
    (["drafter.loss_options.jsd_beta=1.0"], r"drafter\.loss_options\.jsd_beta=1\.0: must be in \(0, 1\)"),
    (["drafter.loss_options.lk_eta=-1"], r"drafter\.loss_options\.lk_eta=-1\.0: must be >= 0"),
])
def test_bad_loss_settings_name_the_key(overrides, key):
    from fledge.conf import compose

    with pytest.raises(ValueError, match=key):
        compose(["recipe=tiny", *overrides])


def test_an_unregistered_part_of_a_mix_fails_before_any_stage():
    """The schema cannot see the registry: train/main.py's check (check_loss_config) names the key."""
    from fledge.conf import compose
    from fledge.train.losses import check_loss_config

    cfg = compose(["recipe=tiny", "drafter.loss=mix", "+drafter.loss_mix={ttt_ce: 0.5, nope: 0.5}"])
    with pytest.raises(ValueError, match=r"drafter\.loss_mix=.*\['nope'\] not registered.*'tv'"):
        check_loss_config(cfg.drafter)
    check_loss_config(compose(["recipe=tiny", "drafter.loss=tv"]).drafter)
