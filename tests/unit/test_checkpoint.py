"""What a checkpoint keeps (train/checkpoint.py), without DeepSpeed: pruning with universal copies beside the
real checkpoints."""

from __future__ import annotations

from fledge.train import checkpoint


def _checkpoint(ckpt_dir, tag, universal=False):
    (ckpt_dir / tag).mkdir(parents=True)
    (ckpt_dir / tag / ("done" if universal else "trainer.json")).write_text("{}")


def test_pruning_keeps_the_real_checkpoints_and_drops_stale_universal_copies(tmp_path):
    """A run saved at step 2 on 2 ranks, resumed on 1 (step_2_universal made to load it), then saved at
    step 4: keep_last=2 keeps steps 2 and 4. The universal copy is not a checkpoint (it was counted as one,
    so step 2 was deleted and the copy kept); it only served the load of step 2, and is stale now."""
    ckpts = tmp_path / "checkpoints"
    _checkpoint(ckpts, "step_00000002")
    _checkpoint(ckpts, "step_00000002_universal", universal=True)
    _checkpoint(ckpts, "step_00000004")
    (ckpts / "latest").write_text("step_00000004")
    checkpoint._prune(ckpts, keep_last=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    _checkpoint(ckpts, "step_00000006")
    (ckpts / "step_00000008").mkdir()  # a save at step 8 cut short (latest never named it), then a resume at 6
    (ckpts / "latest").write_text("step_00000006")
    checkpoint._prune(ckpts, keep_last=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004", "step_00000006", "step_00000008"]
