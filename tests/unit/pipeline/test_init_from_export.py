"""drafter.init_from naming an exported (serving) drafter: the train stage reads it through serving/ into a drafter
checkpoint under train/init_from, so the trainer (which reads no serving format) fine-tunes from the same weights
as from the checkpoint it was exported from, and the run's hash keeps the path the user gave."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fledge.conf import compose
from fledge.data.prepare.vocab import DraftVocab
from fledge.distributed import World
from fledge.pipeline.runner import StageContext
from fledge.pipeline.stages import _init_from_checkpoint, train_inputs
from fledge.run_layout import RunLayout
from fledge.serving.export import export_checkpoint, load_target_config
from fledge.train.checkpoint import drafter_checkpoint
from fledge.train.ttt_model import build_ttt_model

VD = 64


def _context(run: Path, cfg) -> StageContext:
    return StageContext(train_inputs(cfg), World(0, 1, 0, torch.device("cpu")), RunLayout(run), "train", {})


def test_an_export_is_read_into_a_checkpoint_the_trainer_starts_from(random_tiny_target, tmp_path):
    V = json.loads((Path(random_tiny_target) / "config.json").read_text())["vocab_size"]
    counts = torch.randint(1, 1000, (V,), generator=torch.Generator().manual_seed(0))
    DraftVocab.build(counts, VD).save(RunLayout(tmp_path / "run").prepare.vocab)
    base = ["recipe=tiny", f"target.name_or_path={random_tiny_target}", f"drafter.draft_vocab_size={VD}"]
    cfg = compose(base)
    old = build_ttt_model(train_inputs(cfg), RunLayout(tmp_path / "run").prepare.vocab, torch.device("cpu")).drafter
    torch.manual_seed(1)
    with torch.no_grad():
        for p in old.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    ckpt = drafter_checkpoint(train_inputs(cfg), old.spec).write(tmp_path / "ckpt", old.state_dict())
    export_checkpoint(ckpt, tmp_path / "export", load_target_config(cfg.target))

    fine_tune = compose([*base, f"drafter.init_from={tmp_path / 'export'}"])
    inputs = _init_from_checkpoint(_context(tmp_path / "run", fine_tune))
    assert inputs.drafter.init_from == str(tmp_path / "run" / "train" / "init_from")
    assert fine_tune.drafter.init_from == str(tmp_path / "export")  # the config (and so the hash) keeps the user's
    new = build_ttt_model(inputs, RunLayout(tmp_path / "run").prepare.vocab, torch.device("cpu")).drafter
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731  (the export is bf16)
    for name in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"):
        torch.testing.assert_close(new.state_dict()[name], bf16(old.state_dict()[name]), rtol=0, atol=0)

    again = _init_from_checkpoint(_context(tmp_path / "run", compose([*base, f"drafter.init_from={ckpt}"])))
    assert again.drafter.init_from == str(ckpt)  # a checkpoint passes through as it is
