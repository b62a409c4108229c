"""A small target carrying a trained MTP module, for the engine tests that serve one (tests/engine/conftest.py's
``mtp_target``): the tiny ``mla_mtp`` shape, its module trained with it as ``fledge tiny-target mla_mtp`` trains it
(testbed/tiny_mtp.py), but for STEPS steps on a language a few steps teach on any CPU (windows of a fixed cycle
through CYCLE token ids), since the chat answers of a target trained that little are one token or a loop depending
on the CPU. ~20 CPU-s on one thread."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

STEPS, K, MAX_NEW = 60, 2, 32  # joint training steps; served at k = K, MAX_NEW tokens per prompt
CYCLE, FIRST_ID, WINDOW, BATCH = 64, 100, 64, 8  # the language: FIRST_ID.. in a fixed random order, over and over


class SmallMtpTarget(NamedTuple):
    path: Path  # the saved target, its module as model.layers.8.*
    prompts: list[list[int]]  # four 5-token stretches of the cycle
    stop_ids: list[int]
    in_process: dict  # testbed/tiny_mtp.py chain_acceptance at K: what the engine must accept


def _windows(order: torch.Tensor, gen: torch.Generator):
    """Batches of (ids [BATCH, WINDOW + 1], mask of ones): the cycle from random starting points."""
    while True:
        start = torch.randint(0, CYCLE, (BATCH, 1), generator=gen)
        yield order[(start + torch.arange(WINDOW + 1)) % CYCLE], torch.ones(BATCH, WINDOW)


def train_small_mtp_target(out: Path) -> SmallMtpTarget:
    """Train and save the small target into ``out`` (with the tiny tokenizer), and decode its prompts in process."""
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
    tt._save_model(joint.target, tok, out)  # the target in bf16 (and the shared embedding and head)
    tiny_mtp.add_mtp_tensors(out, joint.mtp)
    joint = joint.to(torch.bfloat16).float().eval()  # the module as saved, computed in fp32 as the engine does
    prompts = [order[(s + torch.arange(5)) % CYCLE].tolist() for s in (0, 17, 40, 63)]
    stop = [tok.eos_token_id]
    return SmallMtpTarget(Path(out), prompts, stop,
                          tiny_mtp.chain_acceptance(joint.target, joint.mtp, prompts, K, MAX_NEW, stop))
