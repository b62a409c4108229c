"""train.optim.name=muon under DeepSpeed on gloo ranks (tests/helpers/muon_entry.py, through the trainer's
build_engine): on two ranks, whose flat ZeRO partitions split the Muon matrices between them, the drafter after each
run equals, bit for bit, the same steps of train/optimizers.py's MuonAdamW on the whole matrices without DeepSpeed;
the loss falls; and a fresh engine loaded from the checkpoint at step 2 trains to the same weights, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fledge.train.deepspeed_setup import lr_lambda
from fledge.train.optimizers import build_optimizer
from tests.helpers.muon_entry import STEPS, inputs, one_thread, rows, tiny_model, whole_batch
from tests.helpers.paths import REPO as ROOT
from tests.helpers.suites import FULL_ONLY

pytestmark = pytest.mark.distributed


def run(tmp_path, layout: str, ranks: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "tests.helpers.muon_entry", str(tmp_path), layout]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return load_file(str(tmp_path / "weights.safetensors")), json.loads((tmp_path / "losses.json").read_text())


def without_deepspeed(layout: str) -> dict[str, torch.Tensor]:
    """The same steps on one process: the two rows as the trainer's two micro-batches (each loss over the step's
    denominators, halved as DeepSpeed's backward halves it), MuonAdamW on the whole matrices."""
    o = inputs(layout).train.optim
    model, parts = tiny_model(), rows(whole_batch())
    optimizer = build_optimizer(model, o)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, STEPS))
    for _ in range(STEPS):
        denominators = model.step_denominators(parts, 2.0)
        optimizer.zero_grad()
        for part in parts:
            (model(part, denominators).loss / 2).backward()
        optimizer.step()
        schedule.step()
    return model.drafter.state_dict()


# ZeRO-1 is the full suite's (FLEDGE_ENGINE_FULL=1, CI's 30 minutes): its partitions and step are ZeRO-2's
@pytest.mark.parametrize("layout", ["ranks", pytest.param("zero1", marks=FULL_ONLY)])
def test_muon_under_zero_on_two_ranks_is_muon_on_whole_matrices_and_resumes_exactly(tmp_path, layout):
    weights, losses = run(tmp_path, layout, 2)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses
    with one_thread():
        reference = without_deepspeed(layout)
    for name, want in reference.items():
        assert torch.equal(weights[name], want), name
        assert torch.equal(weights[f"resumed.{name}"], want), name
