"""scripts/compare_losses.py on small fake runs: the table of N runs (loss x seed) with mean and spread over
seeds, per-position acceptance and the training cost, and the sweep's commands (training mocked)."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from fledge.atomic import write_json_atomic
from fledge.run_layout import RunLayout
from tests.helpers.paths import REPO


@pytest.fixture(scope="module")
def cl():
    spec = importlib.util.spec_from_file_location("compare_losses", REPO / "scripts" / "compare_losses.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stats(al, accept_at):
    return {"al": al, "accept_at": accept_at, "rounds": 10}


def fake_run(root: Path, name: str, drafter: dict, seed: int, al: float, tps: list[float], capture="cap1",
             engine_al=None) -> Path:
    """A run directory with what the table reads: the eval report, the train stage's manifest and metrics."""
    d = root / name
    run = RunLayout(d)
    sets = {}
    for set_name, shift in (("default", 0.0), ("long", -0.5)):
        s = {"drafter": _stats(al + shift, [0.8 - 0.1 * i + (al - 2 + shift) / 10 for i in range(3)]),
             "lookup": _stats(1.5, [0.3, 0.1, 0.0]),
             "drafter_sampled": _stats(al + shift - 0.25, [0.7 - 0.1 * i for i in range(3)]),
             "distinct3_mean": 0.07 + shift / 10}
        sets[set_name] = s
    report = {"k": 3, "ttt_steps": 3, "temperature": 1.0, "sets": sets}
    if engine_al is not None:
        report["engine"] = {"sets": {"default": {"drafter": _stats(engine_al, [0.9, 0.6, 0.3]),
                                                 "drafter_sampled": _stats(engine_al - 0.5, [0.6, 0.3, 0.1]),
                                                 "lookup": _stats(1.4, [0.3, 0.1, 0.0])}}}
    write_json_atomic(run.eval.report_json, report)
    write_json_atomic(run.manifest("train"), {
        "seconds": 40.0, "read": {"prepare": "p1", "capture": capture},
        "inputs": {"config": {"drafter": drafter, "run": {"seed": seed}}}})
    run.train.metrics.write_text("".join(
        json.dumps({"step": 10 * (i + 1), "tokens_per_s": t, "loss": 1.0}) + "\n" for i, t in enumerate(tps))
        + json.dumps({"step": 20, "eval/acc_0": 0.5}) + "\n")
    return d


def test_the_table_of_losses_by_seed(cl, tmp_path):
    ce = {"loss": "ttt_ce", "loss_options": {"jsd_beta": 0.5, "lk_eta": 3.0}, "loss_mix": {}}
    mix = {**ce, "loss": "mix", "loss_mix": {"tv": 0.5, "ttt_ce": 0.5}}
    jsd = {**ce, "loss": "jsd", "loss_options": {"jsd_beta": 0.3, "lk_eta": 3.0}}
    runs = [fake_run(tmp_path, "tv_s0", {**ce, "loss": "tv"}, 0, 3.0, [80, 90, 100], engine_al=2.9),
            fake_run(tmp_path, "ce_s0", ce, 0, 2.0, [100, 110, 120]),
            fake_run(tmp_path, "ce_s1", ce, 1, 2.2, [90, 100, 500]),
            fake_run(tmp_path, "tv_s1", {**ce, "loss": "tv"}, 1, 3.4, [70, 80, 90], engine_al=3.1),
            fake_run(tmp_path, "mix_s0", mix, 0, 2.5, [100]),
            fake_run(tmp_path, "jsd_s0", jsd, 0, 2.4, [100])]
    assert cl.main(["table", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    c = json.loads((tmp_path / "out/compare_losses.json").read_text())
    assert c["order"] == ["ttt_ce", "tv", "mix(ttt_ce=0.5,tv=0.5)", "jsd(beta=0.3)"]  # the baseline first
    ce_g, tv_g = c["groups"]["ttt_ce"], c["groups"]["tv"]
    assert ce_g["seeds"] == [0, 1] and tv_g["seeds"] == [0, 1]
    assert ce_g["sets"]["default"]["al"]["mean"] == pytest.approx(2.1)
    assert ce_g["sets"]["default"]["al"]["std"] == pytest.approx(statistics.stdev([2.0, 2.2]))
    assert tv_g["sets"]["long"]["al_sampled"]["mean"] == pytest.approx(3.2 - 0.75)
    assert tv_g["sets"]["default"]["al_engine"]["mean"] == pytest.approx(3.0)
    assert ce_g["sets"]["default"]["al_engine"]["n"] == 0  # no vLLM eval in those runs
    pos = tv_g["sets"]["default"]["accept_at"]
    assert [p["mean"] for p in pos] == pytest.approx([0.92, 0.82, 0.72]) and pos[0]["n"] == 2
    assert pos[0]["std"] == pytest.approx(statistics.stdev([0.9, 0.94]))
    assert c["groups"]["mix(ttt_ce=0.5,tv=0.5)"]["sets"]["default"]["al"]["std"] is None  # one seed: no spread
    # cost: a run's median tokens/s (110 and 100: the 500 outlier does not move the median), mean over seeds
    assert ce_g["tokens_per_s"]["mean"] == pytest.approx(105.0) and tv_g["tokens_per_s"]["mean"] == pytest.approx(85.0)
    assert tv_g["cost_vs_baseline"] == pytest.approx(105 / 85) and ce_g["cost_vs_baseline"] == pytest.approx(1.0)
    assert ce_g["s_per_step"]["mean"] == pytest.approx(40 / 30)
    assert c["warnings"] == []
    md = (tmp_path / "out/compare_losses.md").read_text()
    # per set: greedy, sampled, vLLM greedy, vLLM sampled, then the baselines beside them (lookup, vLLM's
    # ngram) and the target's distinct-3 (what a looping target's AL must be read against)
    assert ("| ttt_ce | 2 | 2.10 ± 0.14 | 1.85 ± 0.14 | n/a | n/a | 1.50 ± 0.00 | n/a | 0.07 ± 0.00 | 1.60 ± 0.14 |"
            in md)
    assert "| tv | 2 | 3.20 ± 0.28 | 2.95 ± 0.28 | 3.00 ± 0.14 | 2.50 ± 0.14 | 1.50 ± 0.00 | 1.40 ± 0.00 |" in md
    assert "default AL vLLM greedy | default AL vLLM sampled | default lookup AL | default vLLM ngram AL" in md
    assert "1.24x |" in md
    assert tv_g["sets"]["default"]["al_engine_sampled"]["mean"] == pytest.approx(2.5)
    assert tv_g["sets"]["default"]["distinct3"]["mean"] == pytest.approx(0.07)
    assert "Acceptance per draft position (greedy, vLLM)" in md and "| default | tv | 0.90 ± 0.00 | 0.60 ± 0.00 |" in md
    assert "Acceptance per draft position (greedy)" in md
    assert "| default | tv | 0.92 ± 0.03 | 0.82 ± 0.03 | 0.72 ± 0.03 |" in md
    assert "Acceptance per draft position (sampled, temperature 1.0)" in md


def test_runs_from_other_features_are_flagged_and_labels_can_be_given(cl, tmp_path):
    ce = {"loss": "ttt_ce"}
    a = fake_run(tmp_path, "a", ce, 0, 2.0, [100], capture="cap1")
    b = fake_run(tmp_path, "b", ce, 1, 2.0, [100], capture="cap2")
    assert cl.main(["table", f"first={a}", f"second={b}", "--out", str(tmp_path / "out")]) == 0
    c = json.loads((tmp_path / "out/compare_losses.json").read_text())
    assert c["order"] == ["first", "second"] and any("different captures" in w for w in c["warnings"])
    with pytest.raises(SystemExit, match="eval/report.json not found"):
        cl.main(["table", str(tmp_path / "nope")])


def test_the_sweep_trains_every_loss_and_seed_from_one_capture(cl, tmp_path, monkeypatch):
    """``run``: one prepare+capture, then per loss x seed a run linking the base's prepare/ and capture/, with
    its seed, its loss and eval at temperature 1; then the table over those runs."""
    calls = []

    def fake_train(nproc, overrides):
        calls.append(overrides)
        o = dict(x.split("=", 1) for x in overrides if "=" in x and not x.startswith("+"))
        run_dir = Path(o["run.output_root"]) / o["run.name"]
        if o["run.stages"] == "[prepare,capture]":
            for stage in ("prepare", "capture"):
                (run_dir / stage).mkdir(parents=True)
            return
        assert (run_dir / "capture").resolve() == (Path(o["run.output_root"]) / "base" / "capture").resolve()
        drafter = {"loss": o["drafter.loss"]}
        mix = [x for x in overrides if x.startswith("+drafter.loss_mix=")]
        if mix:
            drafter["loss_mix"] = {"ttt_ce": 0.5, "tv": 0.5}
        fake_run(Path(o["run.output_root"]), o["run.name"], drafter, int(o["run.seed"]), 2.0, [100.0])

    monkeypatch.setattr("fledge.pipeline.seeds._train_main", fake_train)
    root = tmp_path / "sweep"
    assert cl.main(["run", "--root", str(root), "--losses", "ttt_ce", "mix:ttt_ce=0.5,tv=0.5", "--seeds", "0", "1",
                    "--", "recipe=tiny", "train.max_steps=5"]) == 0
    assert len(calls) == 1 + 2 * 2 and calls[0][-1] == "run.stages=[prepare,capture]"
    for call in calls:
        assert "recipe=tiny" in call and "train.max_steps=5" in call and "eval.temperature=1.0" in call
    names = [next(x for x in c if x.startswith("run.name=")) for c in calls[1:]]
    # seed-major: a sweep cut short has every loss at the seeds it finished
    assert names == ["run.name=ttt_ce_s0", "run.name=mix_ttt_ce0.5_tv0.5_s0", "run.name=ttt_ce_s1",
                     "run.name=mix_ttt_ce0.5_tv0.5_s1"]
    assert "+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}" in calls[2] and "run.seed=1" in calls[4]
    c = json.loads((root / "compare_losses.json").read_text())
    assert c["order"] == ["ttt_ce", "mix(ttt_ce=0.5,tv=0.5)"] and c["groups"]["ttt_ce"]["seeds"] == [0, 1]
    assert json.loads((root / "sweep_times.json").read_text())["total_s"] >= 0


def test_loss_specs(cl):
    assert cl.loss_overrides("tv") == ("tv", ["drafter.loss=tv"])
    with pytest.raises(SystemExit, match="only mix takes parts"):
        cl.loss_overrides("tv:ttt_ce=1")
    with pytest.raises(SystemExit, match="name the parts"):
        cl.loss_overrides("mix")
