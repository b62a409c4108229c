"""`fledge compare` never tables an eval that failed its engine checks: the eval stage writes report.json (with the
engine section's ``failures``) before it fails on them, so such a report looks like any other. It was read, tabled
and averaged over seeds with the rest (evaluation/seeds.py load_run, evaluation/compare.py load_report)."""

from __future__ import annotations

import pytest

from fledge.atomic import write_json_atomic

FAILURE = "eval.engine=vllm, set default: the engine's greedy output differs from plain decoding on 3 prompt(s)"


def _report(failures: list[str]) -> dict:
    drafter = {"al": 2.5, "accept_at": [0.8, 0.5]}
    return {"in_process": True, "flags": {"fc_norm": True, "norm_output": True}, "k": 2, "ttt_steps": 2,
            "sets": {"default": {"drafter": drafter, "lookup": {"al": 1.2}, "distinct3_mean": 0.9}},
            "engine": {"sets": {"default": {"drafter": {"al": 2.4, "accept_at": [0.8, 0.4]}}}, "failures": failures}}


def _run(root, name: str, failures: list[str]):
    write_json_atomic(root / name / "eval" / "report.json", _report(failures))
    write_json_atomic(root / name / "train" / "manifest.json",
                      {"inputs": {"config": {"drafter": {"fc_norm": True, "norm_output": True}, "run": {"seed": 0}}},
                       "read": {"capture": "c"}, "seconds": 1.0})
    return root / name


def test_a_seed_whose_eval_failed_its_engine_checks_is_refused_not_averaged(tmp_path):
    from fledge.evaluation.seeds import load_run

    assert load_run(_run(tmp_path, "good", []))["report"]["sets"]["default"]["drafter"]["al"] == 2.5
    bad = _run(tmp_path, "bad", [FAILURE])
    with pytest.raises(SystemExit, match=r"bad/eval/report.json: its eval failed 1 engine check\(s\) \(eval.engine=vllm"
                                         r".*not compared; fix the drafter or its export and re-run its eval stage"):
        load_run(bad)


def test_two_runs_are_not_compared_when_one_failed_its_engine_checks(tmp_path):
    import fledge.evaluation.compare as cmp

    _run(tmp_path, "r31", [FAILURE])
    _run(tmp_path, "r3", [])
    with pytest.raises(SystemExit, match=r"r31/eval/report.json: its eval failed 1 engine check"):
        cmp.main([str(tmp_path / "r31"), str(tmp_path / "r3"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
