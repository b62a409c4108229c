"""The local metrics log: strict JSON (no NaN), resume truncation, and the reader's view of missing values."""

import json
import math

from fledge.conf import compose
from fledge.evaluation.report import read_metrics
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.train.metrics import MetricsLog


def _strict(line):
    return json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-JSON constant {c}")))


def test_no_data_is_null_not_nan_and_reads_back_as_nan(tmp_path):
    cfg = compose(["recipe=tiny"])
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, 0, cfg.logging, cfg.run.name)
    log.write({"step": 1, "loss_0": 2.5, "acc_2": float("nan"), "lr": float("inf")})
    log.write({"step": 2, "loss_0": 2.0, "acc_2": 0.25})
    rows = [_strict(x) for x in path.read_text().splitlines()]  # every line is strict JSON
    assert rows[0] == {"step": 1, "loss_0": 2.5, "acc_2": None, "lr": None}
    back = read_metrics(path)
    assert math.isnan(back[0]["acc_2"]) and back[1]["acc_2"] == 0.25
    accuracy = StepAccuracy.from_values({"full_acc_0": 0.5, "full_acc_1": back[0]["acc_2"]}, 2)
    assert al_estimate(accuracy) == 1.5


def test_resume_drops_the_killed_runs_later_lines(tmp_path):
    cfg = compose(["recipe=tiny"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss_0": 1.0}) + "\n" for s in (10, 20, 30)) + '{"step": 4')
    MetricsLog(path, 20, cfg.logging, cfg.run.name)
    assert [r["step"] for r in read_metrics(path)] == [10, 20]
