"""A user's mistake reaches them as one line naming the file, line or key and the fix, with exit code 2;
tracebacks are for bugs and for FLEDGE_DEBUG=1. Runs the real entry point (``fledge run``) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ENV.pop("FLEDGE_DEBUG", None)
ENV.pop("HYDRA_FULL_ERROR", None)


def fledge_run(tmp_path, *overrides, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fledge", "run", "recipe=tiny", f"run.output_root={tmp_path / 'out'}", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env or ENV, capture_output=True, text=True, timeout=300)


def prepare_only(tmp_path, target, source):
    return ("run.stages=[prepare]", f"target.name_or_path={target}", f"data.sources.0.path={source}",
            f"data.eval_sources.0.path={source}")


def assert_one_line(res, *needles):
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("fledge: ")]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def test_file_that_is_not_utf8_names_file_and_line(tmp_path, random_tiny_target):
    src = tmp_path / "chat.jsonl"
    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    src.write_bytes(good + b"\xff\xfe not text\n")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src))
    assert_one_line(res, f"{src}:2: not UTF-8", "re-encode the file as UTF-8", "data.on_error=skip")


def test_empty_source_is_named(tmp_path, random_tiny_target):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src))
    assert_one_line(res, f"{src}: no rows", "data.sources[0]")


def test_bad_override_is_one_line_naming_the_key(tmp_path):
    assert_one_line(fledge_run(tmp_path, "drafter.ttt_steps=0"), "drafter.ttt_steps=0")
    assert_one_line(fledge_run(tmp_path, "drafter.bogus=1"), "drafter.bogus")


def test_missing_target_is_a_user_error(tmp_path):
    res = fledge_run(tmp_path, "run.stages=[prepare]", f"target.name_or_path={tmp_path / 'no_such_target'}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-4000:]
    assert "no_such_target" in res.stderr


@pytest.mark.parametrize("var", ["FLEDGE_DEBUG", "HYDRA_FULL_ERROR"])
def test_debug_shows_the_traceback(tmp_path, random_tiny_target, var):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src), env={**ENV, var: "1"})
    assert res.returncode != 0 and "Traceback" in res.stderr and "no rows" in res.stderr
