"""Running the real entry point (``fledge run``) in a subprocess, and what a user error must look like: one
line on stderr naming the file, line or key and the fix, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

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
