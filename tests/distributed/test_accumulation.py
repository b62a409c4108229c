"""One optimizer step's gradient does not depend on how its rows fall into micro-batches and ranks
(train/losses step_denominators, train/deepspeed_setup.py gradient_divisor): under DeepSpeed itself (gloo, fp32),
one rank with grad_accum=2 and two ranks with one micro-batch each hand the optimizer the gradient of one
batch holding both micro-batches' rows, whose counted rows differ 7-fold, and log that batch's loss. The
loss-level equality with the old normalisation as a control is tests/unit/train/test_loss.py::
test_two_micro_batches_train_like_one_batch_holding_both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import REPO as ROOT

FULL_ONLY = pytest.mark.skipif(os.environ.get("FLEDGE_ENGINE_FULL") != "1",
                               reason="the full suite's (FLEDGE_ENGINE_FULL=1): CI's 30 minutes")

pytestmark = pytest.mark.distributed
LAYOUTS = {"whole": 1, "accum": 1, "ranks": 2}  # layout -> ranks


def step(tmp_path_factory, layout: str, stage: int) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp(f"{layout}_zero{stage}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(LAYOUTS[layout]),
           "-m", "tests.helpers.accumulation_entry", str(out), layout, str(stage)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return load_file(str(out / "grads.safetensors")), json.loads((out / "loss.json").read_text())


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return step(tmp_path_factory, "whole", 2)


# ranks-2 is the full suite's (FLEDGE_ENGINE_FULL=1, CI's 30 minutes): ranks-3 (an uneven split) and accum-2 run in CI
@pytest.mark.parametrize("layout, stage", [("accum", 2), pytest.param("ranks", 2, marks=FULL_ONLY),
                                           ("ranks", 3)])
def test_the_step_trains_like_one_batch_of_all_its_rows(tmp_path_factory, whole, layout, stage):
    (g_whole, l_whole), (g, logged) = whole, step(tmp_path_factory, layout, stage)
    assert logged["divisor"] == 2 and l_whole["divisor"] == 1
    assert logged["loss"] == pytest.approx(l_whole["loss"], rel=1e-6)
    assert g.keys() == g_whole.keys() and len(g) > 5
    for name in g_whole:
        assert g_whole[name].abs().max() > 0, name
        torch.testing.assert_close(g[name], g_whole[name], rtol=1e-5, atol=1e-7, msg=f"{layout} zero{stage} {name}")
