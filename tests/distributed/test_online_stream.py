"""Training from a served target (capture.mode=online capture.engine=vllm) through the real entry point on 2 gloo
ranks, with the stand-in engine (tests/helpers/fake_capture_engine.py: the real capture driver over a fake vLLM)
and an untrained tiny target: the default relative run.output_root; a resume at half the steps on half the ranks;
an epoch-mode run whose length is not a multiple of the world; a resume whose steps start off the new step size."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fledge.data.features.reader import BatchIterator
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.distributed
FAKE = ROOT / "tests" / "helpers" / "fake_capture_engine.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
SMALL = ["drafter.ttt_steps=2", "drafter.draft_vocab_size=1024", "train.log_every=1", "train.save_every=2",
         "train.eval_batches=2", "train.optim.warmup_steps=2", "data.perturb.fraction=0", "capture.mode=online",
         "capture.engine=vllm", "capture.buffer_batches=2", "capture.engine_timeout_s=120", "target.dtype=float32"]


@pytest.fixture(scope="module")
def online(tmp_path_factory, random_tiny_target, tiny_data):
    """(work dir, the overrides every run here shares); the engine's python runs the stand-in."""
    work = tmp_path_factory.mktemp("online")
    python = work / "engine-python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    python.chmod(0o755)
    base = ["recipe=tiny", f"target.name_or_path={random_tiny_target}", f"capture.engine_python={python}",
            f"data.sources.0.path={tiny_data}/train.jsonl", "data.sources.0.max_samples=48",
            f"data.eval_sources.0.path={tiny_data}/eval.jsonl", "data.eval_sources.0.max_samples=8", *SMALL]
    return work, base


def fledge(online, *overrides: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """train/main.py under torchrun in the work directory (so run.output_root=outputs is relative to it)."""
    work, base = online
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train" / "main.py"), *base, *overrides]
    return subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=timeout)


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout + res.stderr


def consumed(run: Path, rank: int) -> list[int]:
    """The global batches rank ``rank`` consumed, in order (data/capture/stream.py's record)."""
    path = run / "train" / "stream" / f"rank{rank:05d}" / "train-consumed.jsonl"
    return [json.loads(x)["batch"] for x in path.read_text().splitlines()]


def train_outputs(run: Path) -> dict:
    return json.loads((run / "train" / "manifest.json").read_text())["outputs"]


def test_a_relative_output_root_trains_online(online):
    """run.output_root=outputs (the default), relative to where the command runs, as a new user runs it."""
    log = ok(fledge(online, "run.output_root=outputs", "run.name=relative", "run.stages=[prepare,capture,train]",
                    "train.max_steps=4", "train.eval_every=4"))
    run = online[0] / "outputs" / "relative"
    assert train_outputs(run)["steps"] == 4 and "engine died" not in log
    assert consumed(run, 0) == [0, 2, 4, 6] and consumed(run, 1) == [1, 3, 5, 7]
