"""eval.in_process=false: the eval stage measures its prompt sets with the serving engine alone (a stand-in driver
result here, tests/helpers/engine.py; tests/engine/ serves real vLLM). The in-process harness never runs; the
held-out accuracy, the engine's greedy check, the collapse check and lint still do; the report says which figures
are missing and why."""

import json
import sys

import pytest
import torch

from fledge.pipeline.stages import eval_inputs
from fledge.run_layout import EvalDir, RunLayout
from tests.helpers.engine import fake_driver_result
from tests.helpers.evaluation import eval_cfg


def _engine_only_eval(run, out_dir, monkeypatch, train_al_estimate=None, **result):
    """evaluate_run with eval.engine=vllm and eval.in_process=false over ``fake_driver_result(**result)``, the
    in-process harness replaced by a failure; (the stage's summary, the request the engine was sent)."""
    import fledge.evaluation.engine_eval as EE
    import fledge.evaluation.evaluate as E

    def harness(*args, **kwargs):
        raise AssertionError("the in-process harness ran with eval.in_process=false")

    for name in ("evaluate_set", "drift_curves"):
        monkeypatch.setattr(E, name, harness)
    monkeypatch.setattr(E.Evaluator, "context_buckets", harness)
    sent = {}

    def driver(engine, python, request, workdir, timeout_s):
        sent.update(request)
        return fake_driver_result(request["sets"], **result)

    monkeypatch.setattr(EE, "run_driver", driver)
    cfg = eval_cfg(run)
    cfg.eval.engine, cfg.eval.engine_python, cfg.eval.in_process = "vllm", sys.executable, False
    cfg.eval.draft_tokens = 2  # the stand-in result's k
    summary = E.evaluate_run(eval_inputs(cfg), RunLayout(run / "run").prepare, EvalDir(out_dir),
                             run / "run/export/drafter", torch.device("cpu"), train_al_estimate=train_al_estimate)
    return summary, sent


def test_an_engine_only_eval_runs_no_harness_and_reports_the_engines_figures(run, tmp_path, monkeypatch):
    summary, sent = _engine_only_eval(run, tmp_path, monkeypatch, answer=(1, 2, 3, 1, 2, 3))
    assert set(sent["sets"]) == {"default", "perturbed", "long"}  # the prompt sets, built as with the harness
    assert min(map(len, sent["sets"]["long"])) >= 120 > max(map(len, sent["sets"]["default"]))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["in_process"] is False and report["sets"] == {}
    assert not {"drift", "offline_vs_measured", "context_buckets"} & set(report)
    assert report["heldout"]["steps"] == 4  # teacher-forced, cheap: still measured (the export's estimate)
    e = report["engine"]
    assert e["failures"] == [] and e["lint_errors"] == []
    for name, s in e["sets"].items():
        assert s["in_process_al"] is None and s["al_gap"] is None and s["in_process_lookup_al"] is None, name
        assert s["drafter"]["al"] == 2.0 and s["lookup"]["al"] == 1.25 and s["greedy_differences"] == []
        assert s["distinct3_mean"] == 0.75, name  # the plain output's 3-grams: (1, 2, 3) twice among 4
    # al_<set> stays the in-process AL wherever it is read (goldens, cards): absent here, never the engine's
    assert {k for k in summary if k.startswith("al_")} == {f"al_{kind}_{n}" for kind in ("engine", "lookup_engine")
                                                          for n in ("default", "perturbed", "long")}
    assert summary["al_engine_default"] == 2.0 and summary["al_lookup_engine_default"] == 1.25
    md = (tmp_path / "report.md").read_text()
    assert "measured by the engine alone (eval.in_process=false)" in md
    assert "engine-vs-in-process AL tolerance: not checked" in md
    assert "| default | n/a | n/a | 2.00 | n/a | n/a | n/a | 1.25 | 0.75 |" in md
    assert "| set | drafter | ngram | drafter - ngram | distinct-3 |" in md
    assert "| default | n/a | 1.50 | n/a | 0.75 |" in md  # tokens per forward beside the plain output's distinct-3
    assert "Attention drift" not in md and "Offline estimate vs measured" not in md and "drift.png" not in md
    assert set(report["plots"]) >= {"acceptance.png", "heldout.png"} and "drift.png" not in report["plots"]
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == b"\x89PNG"


def test_an_engine_only_eval_still_fails_on_a_greedy_difference_and_a_collapsed_export(run, tmp_path, monkeypatch):
    """The random export's held-out estimate (~1) is under half of a training-time estimate of 3: a collapse
    found only through the held-out measurement (the engine's AL, 2.0, alone would pass it)."""
    with pytest.raises(ValueError) as failed:
        _engine_only_eval(run, tmp_path, monkeypatch, train_al_estimate=3.0, diverge=(("perturbed", 1),))
    msg = str(failed.value)
    assert "set 'perturbed', prompt 1: vLLM's speculative greedy output differs from its plain greedy output" in msg
    assert "the export's held-out AL estimate" in msg and "collapsed below the training-time estimate 3.00" in msg
    assert "eval.engine_al_tolerance" not in msg
    assert "Engine checks failed" in (tmp_path / "report.md").read_text()  # written before the stage fails


def test_compare_refuses_a_run_measured_by_the_engine_alone(tmp_path):
    """``fledge compare`` sets in-process figures side by side: an engine-only report has none, and is refused with
    the fix rather than compared as empty tables."""
    import fledge.evaluation.compare as cmp
    from fledge.atomic import write_json_atomic

    report = {"in_process": False, "flags": {"fc_norm": True, "norm_output": True}, "k": 2, "ttt_steps": 2, "sets": {}}
    for name in ("r31", "r3"):
        write_json_atomic(tmp_path / name / "eval/report.json", report)
    with pytest.raises(SystemExit, match=r"r31/eval/report.json: measured by the engine alone \(eval.in_process=false\)"
                                         r".*re-run its eval stage with eval.in_process=true"):
        cmp.main([str(tmp_path / "r31"), str(tmp_path / "r3"), "--out", str(tmp_path / "out")])
