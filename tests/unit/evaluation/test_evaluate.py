"""The eval stage end to end on a tiny random target + exported random drafter: report files, sane numbers,
every set, the long set really longer; and the metric helpers (distinct n-grams, acceptance stats)."""

import json
from pathlib import Path

import pytest
import torch

from fledge.atomic import write_json_atomic
from fledge.evaluation.acceptance import acceptance_stats, distinct_ngram_ratio
from fledge.evaluation.speculative import DecodeResult, DrafterProposer, Round
from fledge.pipeline.stages import eval_inputs
from fledge.run_layout import EvalDir, RunLayout
from tests.helpers.evaluation import eval_cfg


@pytest.fixture(scope="module")
def evaluated(run):
    """The eval stage run once on ``run``: (its stage dir, the stage's summary)."""
    from fledge.distributed import World
    from fledge.pipeline.stages import evaluate as run_stage
    from fledge.stage_context import StageContext

    stage_dir = run / "run/eval"
    stage_dir.mkdir()
    cfg = eval_cfg(run)
    cfg.eval.context_buckets, cfg.eval.bucket_prompts = [32, 64], 1  # AL vs context length (evaluation/long_context.py)
    ctx = StageContext(eval_inputs(cfg), World(0, 1, 0, torch.device("cpu")), RunLayout(run / "run"), "eval",
                       {"export": {"outputs": {"drafter": str(run / "run/export/drafter")}}})
    return stage_dir, run_stage(ctx)


def test_eval_stage_writes_report(evaluated):
    stage_dir, summary = evaluated
    report = json.loads((stage_dir / "report.json").read_text())
    assert set(report["sets"]) == {"default", "perturbed", "long"}
    for name, s in report["sets"].items():
        for key in ("drafter", "lookup", "drafter_sampled"):
            assert 1.0 <= s[key]["al"] <= 4.0 and s[key]["rounds"] > 0, (name, key, s[key])
            assert len(s[key]["accept_at"]) == 3
            assert all(a >= b for a, b in zip(s[key]["accept_at"], s[key]["accept_at"][1:]))
        assert s["prompts"] == 3 and 0 <= s["non_degenerate_prompts"] <= 3
        assert abs(s["al_minus_lookup"] - (s["drafter"]["al"] - s["lookup"]["al"])) < 1e-9
        assert summary[f"al_{name}"] == s["drafter"]["al"]
        assert 0 < s["draft_vocab_coverage"] <= 1
    sets = report["sets"]
    assert sets["long"]["prompt_tokens_mean"] >= 120 > sets["default"]["prompt_tokens_mean"]
    assert sets["perturbed"]["prompt_tokens_mean"] > sets["default"]["prompt_tokens_mean"]
    h = report["heldout"]
    assert h["steps"] == 4 and len(h["acc"]) == 4 and all(0 <= a <= 1 for a in h["acc"])
    assert all(f <= a + 1e-9 for f, a in zip(h["full_acc"], h["acc"]))
    assert all(x >= y for x, y in zip(h["full_acc"], h["full_acc"][1:]))
    assert report["drift"]["default"]["depth"] == [0, 1, 2, 3]
    for f in ("report.md", "acceptance.png", "drift.png", "heldout.png", "training.png", "al_vs_length.png"):
        assert (stage_dir / f).stat().st_size > 100, f
    assert (stage_dir / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    md = (stage_dir / "report.md").read_text()
    assert "| default |" in md and "lookup" in md and "Attention drift" in md
    assert f"default {sets['default']['draft_vocab_coverage']:.1%}" in md


def test_eval_measures_the_drafter_config_json_describes(run, tmp_path, monkeypatch):
    """An export whose config.json differs from its training record (eps, activation, norm_output): eval
    measures the drafter an engine would build from config.json + weights, not the record's."""
    import shutil

    import fledge.evaluation.evaluate as E
    from fledge.models.drafter_checkpoint import DrafterCheckpoint
    from fledge.serving.export import load_drafter

    drafter_dir = tmp_path / "drafter"
    shutil.copytree(run / "run/export/drafter", drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    record = DrafterCheckpoint.read_record(drafter_dir)["spec"]
    planted = {"rms_norm_eps": 0.25, "hidden_act": "gelu", "norm_output": not record["norm_output"]}
    (drafter_dir / "config.json").write_text(json.dumps({**config, **planted}))

    class Measured(Exception):
        pass

    def first_set(name, prompts, target_model, drafter, *args):
        raise Measured(drafter)

    monkeypatch.setattr(E, "evaluate_set", first_set)
    with pytest.raises(Measured) as seen:
        E.evaluate_run(eval_inputs(eval_cfg(run)), RunLayout(run / "run").prepare, EvalDir(tmp_path / "eval"),
                       drafter_dir, torch.device("cpu"))
    measured = seen.value.args[0]
    assert {k: getattr(measured.spec, k) for k in planted} == planted
    trained = load_drafter(drafter_dir, embed_weight=measured.embed_tokens.weight)  # the record's drafter
    assert {k: getattr(trained.spec, k) for k in planted} == {k: record[k] for k in planted}
    assert all(torch.equal(p, measured.state_dict()[n]) for n, p in trained.state_dict().items())
    aux = torch.randn(1, 5, measured.spec.fc_in_features, generator=torch.Generator().manual_seed(0))
    ids, pos = torch.tensor([[3, 9, 4, 7, 1]]), torch.arange(5)[None]
    with torch.no_grad():
        from fledge.models.drafter import DraftCache

        out = [d.decode_step(ids, d.fuse(aux), pos, DraftCache())[0] for d in (measured, trained)]
    assert (out[0] - out[1]).abs().max() > 1e-3  # the planted settings change what is served


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert distinct_ngram_ratio([1, 2, 1, 2, 1, 2, 1, 2]) == pytest.approx(2 / 6)
    assert distinct_ngram_ratio([1, 2]) == 1.0


def test_acceptance_stats_skips_budget_limited_rounds():
    a = DecodeResult(tokens=[0] * 9, rounds=[Round(3, 3, 4, False), Round(3, 1, 2, False), Round(1, 1, 2, True)])
    b = DecodeResult(tokens=[0] * 2, rounds=[Round(3, 0, 1, False)])
    s = acceptance_stats([a, b], 3)
    assert s["rounds"] == 3
    assert s["al"] == pytest.approx((4 + 2 + 1) / 3)
    assert s["accept_at"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert s["accept_cond"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert s["al_uncut"] == pytest.approx(1 + (3 + 1 + 0) / 3)  # = al where no round is cut at end-of-turn


def test_al_uncut_counts_drafts_accepted_past_the_end_of_turn_as_an_engine_does():
    """A round that accepts 3 drafts whose first is the end-of-turn token emits 1 token: ``al`` counts 1, an
    engine's 1 + accepted / drafts counts 4 (``al_uncut``), which the eval stage holds vLLM's AL to."""
    cut = DecodeResult(tokens=[0] * 5, rounds=[Round(3, 3, 4, False), Round(3, 3, 1, False)])
    s = acceptance_stats([cut], 3)
    assert s["al"] == pytest.approx((4 + 1) / 2) and s["al_uncut"] == pytest.approx(4.0)


def test_lookup_al_per_draft_counts_only_the_rounds_that_drafted_as_vllm_counts_ngram():
    """Prompt lookup's rounds without a match propose nothing: ``al`` counts each as AL 1, vLLM's ngram counters
    count no draft (1 + accepted / drafts), which ``al_per_draft`` follows; the drafter always drafts, so for it
    the two counts of an engine agree (``al_per_draft`` = ``al_uncut``)."""
    look = DecodeResult(tokens=[0] * 7, rounds=[Round(0, 0, 1, False), Round(0, 0, 1, False), Round(3, 2, 3, False),
                                                Round(2, 0, 1, False), Round(3, 3, 4, True)])
    s = acceptance_stats([look], 3)
    assert s["al"] == pytest.approx((1 + 1 + 3 + 1) / 4) and s["al_uncut"] == pytest.approx(1 + 2 / 4)
    assert s["drafts"] == 2 and s["al_per_draft"] == pytest.approx(1 + 2 / 2)
    drafter = DecodeResult(tokens=[0] * 5, rounds=[Round(3, 3, 4, False), Round(3, 3, 1, False)])
    d = acceptance_stats([drafter], 3)
    assert d["drafts"] == 2 and d["al_per_draft"] == pytest.approx(d["al_uncut"])


def test_eval_reports_al_vs_context_length(evaluated):
    stage_dir, _ = evaluated
    buckets = json.loads((stage_dir / "report.json").read_text())["context_buckets"]
    assert [b["bucket"] for b in buckets] == [32, 64]
    for b in buckets:
        assert b["prompts"] == 1 and b["bucket"] - 24 < b["prompt_tokens_mean"] <= b["bucket"]
        assert 1.0 <= b["al"] <= 4.0 and b["drift"]["depth"] == [0, 1, 2, 3]
        assert 1.0 <= b["al_sampled"] <= 4.0  # eval.temperature 0.8: the sampled AL of the same prompts
    md = (stage_dir / "report.md").read_text()
    assert "## Acceptance vs context length" in md and "| 32 | 1 |" in md and "| 64 | 1 |" in md
    assert "AL (sampled)" in md


def test_compare_script(evaluated, tmp_path):
    """``fledge compare`` on two runs' reports (the eval stage's report, flags set per kind)."""
    import fledge.evaluation.compare as cmp

    base = json.loads((evaluated[0] / "report.json").read_text())
    for name, flag, scale in (("r31", True, 1.0), ("r3", False, 0.5)):
        rep = json.loads(json.dumps(base))
        rep["flags"] = {"fc_norm": flag, "norm_output": flag}
        rep["sets"]["default"]["drafter"]["al"] *= scale
        rep["context_buckets"][1]["al"] *= scale
        rep["context_buckets"][0]["al_sampled"] = 3.0 * scale
        rep["sets"]["perturbed"]["drafter_sampled"]["al"] = 2.0 * scale
        if name == "r3":  # a greedy-only bucket on one side: no sampled ratio for it
            rep["context_buckets"][1]["al_sampled"] = None
        write_json_atomic(tmp_path / name / "eval/report.json", rep)
    assert cmp.main([str(tmp_path / "r31"), str(tmp_path / "r3"), "--out", str(tmp_path / "out")]) == 0
    c = json.loads((tmp_path / "out/compare.json").read_text())
    assert c["sets"]["default"]["al_ratio"] == pytest.approx(2.0)
    assert c["sets"]["long"]["al_ratio"] == pytest.approx(1.0)
    md = (tmp_path / "out/compare.md").read_text()
    assert "AL(3.1)/AL(3)" in md and "| default |" in md and "Held-out" in md
    assert [r["al_ratio"] for r in c["context"]] == pytest.approx([1.0, 2.0])  # AL vs context length
    assert "Acceptance vs context length" in md and "| 64 | 1 |" in md
    assert c["sets"]["perturbed"]["al_sampled_ratio"] == pytest.approx(2.0) and c["temperature"] == 0.8
    assert [r.get("al_sampled_ratio") for r in c["context"]] == [pytest.approx(2.0), None]
    assert "| perturbed | 2.00 | 1.00 | 2.00 |" in md and "| 32 | 3.00 | 1.50 | 2.00 |" in md
    for f in ("compare_acceptance.png", "compare_drift.png", "compare_heldout.png", "compare_gap.png",
              "compare_al_vs_length.png"):
        assert (tmp_path / "out" / f).read_bytes()[:4] == b"\x89PNG"


def test_greedy_mismatch_is_an_error(monkeypatch):
    """A speculative output that leaves plain greedy decoding (not at a numerical tie) fails the stage."""
    from types import SimpleNamespace

    import fledge.evaluation.acceptance as ev
    from tests.helpers.models import random_drafter, random_llama
    target = random_llama()
    drafter = random_drafter(target)
    cfg = SimpleNamespace(draft_tokens=2, max_new_tokens=8, lookup_max_ngram=3, temperature=0.0,
                          degenerate_threshold=0.5)
    prompts = [[1, 5, 9, 13, 5]]
    assert ev.evaluate_set("default", prompts, target, drafter, cfg, [], 0)["greedy_ties"] == 0
    real = ev.speculative_decode

    def corrupt(*args, **kw):
        res = real(*args, **kw)
        if not kw.get("temperature") and isinstance(args[1], DrafterProposer):
            res.tokens[3] = (res.tokens[3] + 1) % target.config.vocab_size
        return res

    monkeypatch.setattr(ev, "speculative_decode", corrupt)
    with pytest.raises(AssertionError, match="differs from plain greedy"):
        ev.evaluate_set("default", prompts, target, drafter, cfg, [], 0)


class _FeatureTarget:
    """A stand-in frozen target for held-out accuracy: aux states and argmax are fixed functions of the ids
    (what the drafter reads; the real target's forward is not what these tests are about)."""

    device = torch.device("cpu")

    def __init__(self, width, vocab=50, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, width, generator=g)

    def capture(self, x, chunk_tokens=0):
        return self.table[x], None, (x * 7 + 3) % 40


def _per_sample_heldout(drafter, frozen, samples, steps):
    """held-out accuracy as it was written before rows were packed: one unpadded row per sample."""
    from fledge.models import alignment

    hit, full, rows = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    for ids, mask in samples:
        x = torch.tensor([ids])
        aux, _, argmax = frozen.capture(x)
        T = x.shape[1]
        doc, pos, m = torch.zeros(1, T, dtype=torch.int32), torch.arange(T)[None], torch.tensor([mask])
        all_ok = torch.ones(1, T, dtype=torch.bool)
        for j, y in enumerate(alignment.unroll(drafter, aux, x, pos, doc, steps)):
            step = alignment.step_rows(m, doc, argmax, drafter.t2d, j)
            ok = drafter.draft_to_target(drafter.lm_head(y).argmax(-1)) == step.teacher_argmax
            all_ok &= ok
            hit[j] += float((ok & step.scored).sum())
            full[j] += float((all_ok & step.scored).sum())
            rows[j] += float(step.scored.sum())
    return (hit / rows.clamp_min(1)).tolist(), (full / rows.clamp_min(1)).tolist(), rows.tolist()


def test_heldout_accuracy_shows_flex_a_bounded_set_of_lengths(monkeypatch):
    """50 held-out samples of 50 different lengths: flex (compiled with static shapes on GPU, one compile per
    key length) sees one row length, not one per sample; the numbers equal one unpadded row per sample."""
    import fledge.models.attention as A
    from fledge.evaluation.heldout import heldout_accuracy
    from tests.helpers.models import make_drafter

    g = torch.Generator().manual_seed(0)
    lengths = [4 + 3 * i for i in range(50)]
    samples = [(torch.randint(0, 50, (n,), generator=g).tolist(), (torch.rand(n, generator=g) > 0.2).tolist())
               for n in lengths]
    drafter = make_drafter(attention="flex")
    frozen = _FeatureTarget(drafter.spec.fc_in_features)
    seen = set()
    real = A._flex
    monkeypatch.setattr(A, "_flex", lambda q, *a: seen.add(q.shape[2]) or real(q, *a))
    steps = 3
    got = heldout_accuracy(drafter, frozen, samples, steps)
    assert len(seen) <= 3, f"flex saw {len(seen)} row lengths for {len(set(lengths))} sample lengths"
    monkeypatch.setattr(A, "_flex", real)
    with torch.inference_mode():
        acc, full_acc, rows = _per_sample_heldout(make_drafter(attention="sdpa"), frozen, samples, steps)
    assert got["rows"] == rows and min(rows) > 100
    assert got["acc"] == pytest.approx(acc, abs=1e-6) and got["full_acc"] == pytest.approx(full_acc, abs=1e-6)


def _strict_json(path: Path):
    """``path`` parsed the way jq, JavaScript and dashboards parse JSON: NaN / Infinity are refused."""
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_compare_over_seeds_tables_mean_and_spread_and_the_perturbation(evaluated, tmp_path, monkeypatch):
    """``fledge compare --train``: both drafters at every seed from one capture (training mocked here), then the
    table over seeds: each drafter's mean ± std per set and AL kind, the ratio of means beside the paper's,
    perturbed over default AL per drafter, AL per context length; wrong flags are flagged."""
    import fledge.evaluation.compare as cmp

    base = json.loads((evaluated[0] / "report.json").read_text())
    calls = []

    def fake_train(nproc, overrides):
        calls.append(overrides)
        o = dict(x.split("=", 1) for x in overrides if "=" in x)
        run = RunLayout(Path(o["run.output_root"]) / o["run.name"])
        if o["run.stages"] == "[prepare,capture]":
            return
        is31, seed = o["drafter"] == "eagle31", int(o["run.seed"])
        rep = json.loads(json.dumps(base))
        rep["flags"] = {"fc_norm": is31, "norm_output": is31}
        rep["sets"]["system_long"] = json.loads(json.dumps(rep["sets"]["default"]))  # a perturbation set
        for name, al in (("default", 3.0), ("perturbed", 3.0 if is31 else 1.5), ("long", 2.0),
                         ("system_long", 2.7 if is31 else 1.0)):
            rep["sets"][name]["drafter"]["al"] = (al if is31 else min(al, 2.0)) + 0.1 * seed
        rep["sets"]["default"]["drafter"]["accept_at"] = [0.5 + 0.1 * seed * is31, 0.25, 0.0][:base["k"]]
        rep["context_buckets"][0]["al"] = 2.0 + (0.0 if is31 else -1.0)
        write_json_atomic(run.eval.report_json, rep)
        write_json_atomic(run.manifest("train"), {"seconds": 10.0, "read": {"capture": "c1"}, "inputs": {"config": {
            "drafter": {"fc_norm": is31, "norm_output": is31}, "run": {"seed": seed}}}})

    monkeypatch.setattr("fledge.pipeline.seeds._train_main", fake_train)
    root = tmp_path / "cmp"
    from fledge.pipeline.seeds import compare_main

    assert compare_main(["--train", str(root), "--seeds", "0", "1", "2", "--", "recipe=tiny", "train.max_steps=5"]) == 0
    assert len(calls) == 1 + 3 * 2 and all("eval.temperature=1.0" in c and "recipe=tiny" in c for c in calls)
    c = json.loads((root / "compare" / "compare.json").read_text())["seeds"]
    d = c["sets"]["default"]
    assert d["EAGLE-3.1"]["al"]["mean"] == pytest.approx(3.1) and d["EAGLE-3.1"]["al"]["std"] == pytest.approx(0.1)
    assert d["ratio"]["al"] == pytest.approx(3.1 / 2.1) and d["paper"].startswith("1.10x")
    p = c["perturbed_vs_default"]
    assert p["perturbed"]["EAGLE-3"]["al"] == pytest.approx(1.6 / 2.1)  # EAGLE-3 moved by the template
    assert p["perturbed"]["EAGLE-3.1"]["al"] == pytest.approx(1.0)
    assert p["system_long"]["EAGLE-3"]["al"] == pytest.approx(1.1 / 2.1) and set(p) == {"perturbed", "system_long"}
    assert c["sets"]["system_long"]["paper"].startswith("up to 2x")
    # the standard sets' mean ratio (the paper's 1.10x): here default alone
    assert c["standard_mean_ratio"] == {"sets": ["default"], "ratio": pytest.approx(3.1 / 2.1)}
    # AL at every depth k' <= k from the k run: 1 + cumulative P(accepted >= i), over seeds
    depth = c["depth"]["default"]
    assert depth["EAGLE-3.1"][0]["mean"] == pytest.approx(1.6) and depth["EAGLE-3.1"][0]["std"] == pytest.approx(0.1)
    assert depth["EAGLE-3"][1]["mean"] == pytest.approx(1.75) and len(depth["EAGLE-3"]) == base["k"]
    assert c["context"][0]["ratio"] == pytest.approx(2.0) and c["seeds"]["EAGLE-3"] == [0, 1, 2]
    assert c["warnings"] == []
    md = (root / "compare" / "compare.md").read_text()
    assert "over seeds" in md and "| default | greedy | 3.10 ± 0.10 | 2.10 ± 0.10 | 1.48x | 1.10x" in md
    assert "Perturbed over default AL per drafter" in md and "The first seed's pair in detail" in md
    assert "| system_long | greedy | 0.90 | 0.52 |" in md and "Greedy AL by draft depth" in md
    assert "Mean AL(3.1)/AL(3) over the standard sets (default)" in md
    assert (root / "compare" / "compare_drift.png").exists() and (root / "compare" / "compare_al_vs_depth.png").exists()
    # the same table from the run directories; a run on the wrong side is flagged
    runs31 = [str(root / f"eagle31_s{s}") for s in range(3)]
    assert cmp.main(["--eagle31", *runs31[:2], str(root / "eagle3_s2"), "--eagle3", str(root / "eagle3_s0"),
                     "--out", str(tmp_path / "o")]) == 0
    assert "not the drafter" in json.loads((tmp_path / "o" / "compare.json").read_text())["seeds"]["warnings"][0]
    with pytest.raises(SystemExit):
        cmp.main(["--eagle31", runs31[0]])
    # an eval cut short (report.partial.json) is read only with --partial, and flagged in the table
    cut = RunLayout(root / "eagle3_s1").eval
    cut.report_json.rename(cut.partial_json)
    runs3 = [str(root / f"eagle3_s{s}") for s in range(3)]
    with pytest.raises(SystemExit, match="not found"):
        cmp.main(["--eagle31", *runs31, "--eagle3", *runs3, "--out", str(tmp_path / "p")])
    assert cmp.main(["--partial", "--eagle31", *runs31, "--eagle3", *runs3, "--out", str(tmp_path / "p")]) == 0
    warned = json.loads((tmp_path / "p" / "compare.json").read_text())["seeds"]["warnings"]
    assert any("cut short" in w and "eagle3_s1" in w for w in warned)


def test_report_and_compare_are_strict_json_when_no_prompt_is_non_degenerate(run, tmp_path):
    """A set with no non-degenerate prompt has no non-degenerate AL: report.json (and compare.json made from
    two such reports) carry null there, never NaN, which strict parsers refuse."""
    import fledge.evaluation.compare as cmp
    import fledge.evaluation.evaluate as E

    cfg = eval_cfg(run)
    cfg.eval.sets, cfg.eval.num_prompts, cfg.eval.temperature = ["default"], 2, 0.0
    cfg.eval.degenerate_threshold = 1.01  # no output's distinct-3-gram ratio reaches it: every prompt degenerate
    E.evaluate_run(eval_inputs(cfg), RunLayout(run / "run").prepare, EvalDir(tmp_path / "r31" / "eval"),
                   run / "run/export/drafter", torch.device("cpu"))
    report = _strict_json(tmp_path / "r31" / "eval" / "report.json")
    s = report["sets"]["default"]
    assert s["non_degenerate_prompts"] == 0 and s["drafter_non_degenerate"]["al"] is None
    assert s["al_minus_lookup_non_degenerate"] is None and 1.0 <= s["drafter"]["al"] <= 4.0
    rep3 = json.loads(json.dumps(report))
    rep3["flags"] = {"fc_norm": False, "norm_output": False}
    write_json_atomic(tmp_path / "r3" / "eval" / "report.json", rep3)
    assert cmp.main([str(tmp_path / "r31"), str(tmp_path / "r3"), "--out", str(tmp_path / "out")]) == 0
    c = _strict_json(tmp_path / "out" / "compare.json")
    assert c["sets"]["default"]["al_ratio_non_degenerate"] is None and c["sets"]["default"]["al_ratio"] == 1.0
    assert "| default |" in (tmp_path / "out" / "compare.md").read_text()


def test_json_writer_writes_null_for_non_finite_numbers(tmp_path):
    """Manifests, stores and reports all go through write_json_atomic: NaN and +-inf become null."""
    write_json_atomic(tmp_path / "m.json", {"al": float("nan"), "gap": [1.5, float("inf")], "x": {"y": -float("inf")}})
    assert _strict_json(tmp_path / "m.json") == {"al": None, "gap": [1.5, None], "x": {"y": None}}


def test_the_report_says_how_much_of_the_target_output_the_draft_vocab_covers():
    """Per set, the share of the target's greedy output tokens that lie in the draft vocab (the tokens the
    drafter can propose at all), measured on the eval output and shown in report.md."""
    from types import SimpleNamespace

    import fledge.evaluation.acceptance as ev
    from fledge.evaluation.report import markdown
    from fledge.evaluation.speculative import TargetRunner, greedy_decode
    from tests.helpers.models import random_drafter, random_llama

    target = random_llama()
    drafter = random_drafter(target, vd=48)  # half of the 96 target ids
    cfg = SimpleNamespace(draft_tokens=2, max_new_tokens=16, lookup_max_ngram=3, temperature=0.0,
                          degenerate_threshold=0.5)
    prompts = [[1, 5, 9, 13, 5], [7, 3, 2], [40, 41, 42, 43]]
    out = ev.evaluate_set("default", prompts, target, drafter, cfg, [], 0)
    written = [t for p in prompts for t in greedy_decode(TargetRunner(target), p, 16, [])[0]]
    want = sum(bool(drafter.t2d[t]) for t in written) / len(written)
    assert 0 < want < 1  # the random vocab leaves some of what the target writes out
    assert out["draft_vocab_coverage"] == pytest.approx(want)
    report = {"k": 2, "flags": {"fc_norm": True, "norm_output": True}, "drafter": "d", "max_new_tokens": 16,
              "degenerate_threshold": 0.5, "temperature": 0.0,
              "sets": {"default": out, "long": {**out, "draft_vocab_coverage": 0.5}}}
    md = markdown(report)
    assert "draft vocab" in md and f"default {want:.1%}" in md and "long 50.0%" in md


def test_the_report_names_the_drafters_algorithm_and_its_round():
    """A DFlash, DSpark, P-EAGLE or MTP drafter's report is not headed EAGLE-3 (its flags alone say so), nor its
    one-forward round called a chain; a report written before the algorithm was recorded reads as EAGLE's."""
    from fledge.evaluation.report import _opening, drafter_kind

    base = {"drafter": "d", "k": 5, "max_new_tokens": 96, "flags": {"fc_norm": False, "norm_output": False}}
    assert drafter_kind(base) == "EAGLE-3" and "chain of k=5 drafts" in _opening(base)
    assert drafter_kind({**base, "flags": {"fc_norm": True, "norm_output": True}, "algorithm": "eagle"}) == "EAGLE-3.1"
    for algorithm, name, round_ in (("dflash", "DFlash", "a block of k=5 drafts in one drafter forward"),
                                    ("dspark", "DSpark", "a block of k=5 drafts"),
                                    ("peagle", "P-EAGLE", "k=5 parallel drafts in one drafter forward"),
                                    ("mtp", "MTP", "chain of k=5 drafts")):
        report = {**base, "algorithm": algorithm}
        assert drafter_kind(report) == name and round_ in _opening(report), algorithm
