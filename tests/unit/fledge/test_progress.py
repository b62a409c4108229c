"""Progress in a log is plain lines at an interval, never a bar's carriage-return updates (fledge/progress.py): a
Slurm log of the tiny recipe held single lines of tens of KB."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from fledge import progress as progress_module
from fledge.progress import LineProgress, progress, quiet_library_bars
from tests.helpers.cli import ENV
from tests.helpers.paths import REPO


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_log_gets_a_line_every_interval_and_one_at_the_end():
    clock, out = Clock(), io.StringIO()
    bar = LineProgress(total=100, initial=10, desc="train", every_s=30, file=out, clock=clock)
    for _ in range(9):  # 10 steps every 10 s: lines at 30, 60 and 90 s
        clock.t += 10
        bar.update(10)
        bar.set_postfix(loss="1.234")
    bar.close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 3, lines  # the end falls on the 90 s line: not twice
    assert lines[0] == "train: 40/100 it (40%), 1 it/s, 00:30 elapsed, 01:00 left, loss=1.234", lines
    assert lines[-1] == "train: 100/100 it (100%), 1 it/s, 01:30 elapsed, loss=1.234", lines


def test_the_end_of_a_loop_is_a_line_of_its_own_and_an_idle_or_disabled_one_prints_nothing():
    clock, out = Clock(), io.StringIO()
    for _ in LineProgress(range(3), desc="eval default", every_s=30, file=out, clock=clock):
        clock.t += 1
    assert out.getvalue() == "eval default: 3/3 it (100%), 1 it/s, 00:03 elapsed\n"
    quiet = io.StringIO()
    LineProgress(total=5, file=quiet, clock=clock).close()
    bar = LineProgress(total=5, disable=True, every_s=0, file=quiet, clock=clock)
    bar.update(5)
    bar.close()
    assert quiet.getvalue() == ""
    tokens = io.StringIO()
    with LineProgress(total=4_000_000, unit="tok", unit_scale=True, desc="capture", file=tokens, clock=clock) as b:
        clock.t += 4
        b.update(1_500_000)
    assert tokens.getvalue().startswith("capture: 1.50M/4.00M tok (38%), 375k tok/s, 00:04 elapsed"), tokens.getvalue()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tqdms_bar_only_on_a_terminal(monkeypatch):
    from tqdm import tqdm

    monkeypatch.setattr("sys.stderr", _Tty())
    assert isinstance(progress(range(2)), tqdm)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress(range(2)), LineProgress)
    monkeypatch.setenv("FLEDGE_PROGRESS_S", "5")
    assert progress(total=3).every_s == 5.0


def test_the_libraries_bars_are_off_in_a_log_unless_the_user_set_them(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    import datasets

    quiet_library_bars()
    assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1" and not datasets.is_progress_bar_enabled()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # the user's own setting
    datasets.enable_progress_bars()


def test_every_progress_bar_goes_through_the_helper():
    """One helper decides bar or lines (a call site of its own tqdm would write carriage returns into logs)."""
    offenders = []
    for root in ("pipeline", "train", "data", "evaluation", "serving", "models", "testbed", "fledge"):
        for path in (REPO / root).rglob("*.py"):
            if path.resolve() == Path(progress_module.__file__).resolve():
                continue
            if "vllm_side" in path.parts:  # runs under the engine's python, with use_tqdm=False
                continue
            if re.search(r"^\s*(from tqdm|import tqdm)", path.read_text(), re.M):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"tqdm used directly in {offenders}: use fledge.progress.progress"


def test_a_pipeline_run_in_a_log_writes_lines_not_carriage_returns(tmp_path, random_tiny_target, tiny_data):
    """prepare (datasets' map), capture and train, stderr a pipe as under Slurm (read as bytes: text mode would
    turn each carriage return into a line break)."""
    cmd = [sys.executable, "-m", "fledge", "run", "recipe=tiny", f"run.output_root={tmp_path / 'out'}",
           "run.stages=[prepare,capture,train]", f"target.name_or_path={random_tiny_target}",
           f"data.sources=[{{path: {tiny_data}/train.jsonl, max_samples: 8}}]",
           f"data.eval_sources=[{{path: {tiny_data}/eval.jsonl, max_samples: 2}}]", "train.max_steps=2",
           "train.eval_every=2"]
    res = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "FLEDGE_PROGRESS_S": "0"}, capture_output=True, timeout=300)
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 0, err[-4000:]
    assert "\r" not in err, [x for x in err.split("\n") if "\r" in x][:3]
    assert re.search(r"^capture train: \S+/\S+ tok \(\d+%\)", err, re.M), err[-4000:]
    assert re.search(r"^train: 2/2 it \(100%\)", err, re.M), err[-4000:]
