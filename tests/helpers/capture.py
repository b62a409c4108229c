"""Two prepared run directories with the same data and a small random Llama target, for the capture tests
on 2 ranks (tests/distributed/test_capture_resume.py, test_capture_slices.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

L, H, V, N = 6, 48, 128, 96


def prepare_runs(root: Path) -> None:
    """``root/target`` and the prepared runs ``root/a``, ``root/b`` (the same data)."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=V, max_position_embeddings=256)
                     ).save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    for run in ("a", "b"):
        for split, n in (("train", N), ("eval", 10)):
            g.manual_seed(hash(split) % 1000)
            lens = torch.randint(4, 60, (n,), generator=g).tolist()
            Dataset.from_dict({
                "input_ids": [torch.randint(0, V, (k,), generator=g).int().tolist() for k in lens],
                "loss_mask": [torch.randint(0, 2, (k,), generator=g).to(torch.int8).tolist() for k in lens],
            }).save_to_disk(str(root / run / "prepare" / split))
        (root / run / "prepare" / "manifest.json").write_text(
            json.dumps({"stage": "prepare", "inputs_hash": "fake", "complete": True, "outputs": {}}))
