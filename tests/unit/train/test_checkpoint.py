"""What a checkpoint keeps and what a resume reads from it (train/checkpoint.py), without DeepSpeed: pruning
with universal copies beside the real checkpoints, and the resume plan (data position, run length, lr
schedule) when the resumed run has another world size or gradient accumulation than the one that saved."""

from __future__ import annotations

import pytest

from fledge.conf import compose
from fledge.pipeline.stages import train_inputs
from fledge.train import checkpoint
from fledge.train.deepspeed_setup import lr_lambda


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


def _cfg(*overrides):
    return compose(["recipe=tiny", "train.optim.warmup_steps=2", *overrides])


def _train(*overrides):
    """The train section the resume plan reads."""
    return _cfg(*overrides).train


def _saved(step, batches, per_step, total, count=None, decay_from=None):
    """trainer.json as train/trainer.py writes it (the fields the resume plan reads)."""
    return {"step": step, "batches": batches, "batches_per_step": per_step,
            "schedule": {"total": total, "count": step if count is None else count, "decay_from": decay_from}}


def test_the_resume_plan_seeks_the_batches_consumed_not_step_times_todays_step():
    """2 steps at 2 ranks x 1 micro-batch consumed global batches 0..3; 1 rank continues at batch 4."""
    plan = checkpoint.resume_plan(_saved(2, 4, 2, 10), _train("train.max_steps=10"), per_step=1,
                                  batches_per_epoch=20)
    assert (plan.step, plan.batches, plan.total) == (2, 4, 10)  # max_steps counts optimizer steps


def test_epochs_end_where_the_data_ends_on_any_step_size():
    """train.epochs is data: 1 epoch of 20 global batches is 10 steps at 2 per step; resumed after 6 of them
    (12 batches) at 1 per step, 8 steps remain (not 20 - 6, which replays 6 batches of the next epoch)."""
    cfg = _train("train.max_steps=0", "train.epochs=1")
    assert checkpoint.resume_plan({}, cfg, per_step=2, batches_per_epoch=20).total == 10
    assert checkpoint.resume_plan(_saved(6, 12, 2, 10), cfg, per_step=1, batches_per_epoch=20).total == 14
    assert checkpoint.resume_plan(_saved(6, 12, 2, 10), cfg, per_step=4, batches_per_epoch=20).total == 8
    assert checkpoint.resume_plan(_saved(10, 20, 2, 10), cfg, per_step=1, batches_per_epoch=20).total == 10


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_lr_schedule_continues_when_the_step_size_changes_the_run_length(schedule):
    """Epochs at 2 batches per step: 10 steps. Resumed at step 6 with 1 per step, the run has 14 steps: the
    lr goes on from where it was (no jump back up the curve) and reaches the minimum at step 14; a second
    resume keeps that curve. Without a change of step size the schedule is the plain one."""
    cfg = _train("train.max_steps=0", "train.epochs=1", f"train.optim.schedule={schedule}",
               "train.optim.min_lr_ratio=0.1")
    old = lr_lambda(cfg.optim, 10)
    plan = checkpoint.resume_plan(_saved(6, 12, 2, 10), cfg, per_step=1, batches_per_epoch=20)
    new = lr_lambda(cfg.optim, plan.total, plan.decay_from)
    assert new(6) == pytest.approx(old(6))
    assert new(7) < new(6) and new(14) == pytest.approx(0.1)
    assert [new(s) for s in range(7, 15)] == sorted((new(s) for s in range(7, 15)), reverse=True)
    again = checkpoint.resume_plan(_saved(9, 15, 1, plan.total, decay_from=plan.decay_from), cfg, per_step=1,
                                   batches_per_epoch=20)
    assert again.total == 14 and [lr_lambda(cfg.optim, 14, again.decay_from)(s) for s in range(9, 15)] == \
        [new(s) for s in range(9, 15)]
    same = checkpoint.resume_plan(_saved(6, 12, 2, 10), cfg, per_step=2, batches_per_epoch=20)
    assert same.decay_from is None and [lr_lambda(cfg.optim, same.total)(s) for s in range(12)] == \
        [old(s) for s in range(12)]


def test_a_checkpoint_without_a_data_position_resumes_as_before():
    """trainer.json written before the data position was stored: step x today's step size."""
    plan = checkpoint.resume_plan({"step": 3, "world_size": 2}, _train("train.max_steps=10"), per_step=2,
                                  batches_per_epoch=20)
    assert (plan.step, plan.batches, plan.total, plan.decay_from) == (3, 6, 10, None)


def test_a_longer_run_says_the_lr_schedule_is_respanned_over_its_new_length():
    """A finished 100-step cosine run raised to 200 steps: its lr had decayed to the floor (1e-4 = 0.1 x 1e-3) and
    the schedule recomputed over 200 steps puts step 100 back near the middle of the curve. The resume message says
    so, with both lrs (extending the old schedule instead would train the 100 new steps at the floor). The same
    end, a constant schedule, and a step-size change whose decay carries on are resumed without a word."""
    cfg = _train("train.max_steps=200", "train.optim.min_lr_ratio=0.1")
    plan = checkpoint.resume_plan(_saved(100, 100, 1, 100), cfg, per_step=1, batches_per_epoch=1000)
    before, after = 1e-3 * lr_lambda(cfg.optim, 100)(100), 1e-3 * lr_lambda(cfg.optim, 200)(100)
    assert before == pytest.approx(1e-4) and after > 5e-4
    assert plan.note == (
        "train: the lr schedule ended at step 100 and the run now ends at step 200 (train.max_steps / "
        "train.epochs changed): the train.optim.schedule=cosine decay is recomputed over the new length, so the lr "
        f"at step 100 goes from 0.0001 to {after:.3g}; the 100 steps trained so far ran under the 100-step schedule "
        "(run.force=[train] trains the whole run under one)")
    assert checkpoint.resume_plan(_saved(50, 50, 1, 200), cfg, per_step=1, batches_per_epoch=1000).note is None
    constant = _train("train.max_steps=200", "train.optim.schedule=constant")
    assert checkpoint.resume_plan(_saved(100, 100, 1, 100), constant, per_step=1, batches_per_epoch=1000).note is None
    epochs = _train("train.max_steps=0", "train.epochs=1")
    assert checkpoint.resume_plan(_saved(6, 12, 2, 10), epochs, per_step=1, batches_per_epoch=20).note is None


def test_a_block_drafters_checkpoint_records_its_block_settings_and_a_chain_drafters_does_not():
    """The training record says how a DFlash drafter was trained (block size, anchors, decay, layers), from
    the algorithm's block flag (models/algorithms.py), not a name test; an EAGLE record carries none of them."""
    from fledge.models.algorithms import DrafterSpec
    from tests.helpers.models import DFLASH_TARGET, dflash_cfg, make_drafter

    cfg = _cfg("drafter=dflash", "drafter.block_size=6", "drafter.num_anchors=64")
    spec = DrafterSpec.from_target_config(DFLASH_TARGET, dflash_cfg(block_size=6), [2, 4, 5])
    training = checkpoint.drafter_checkpoint(train_inputs(cfg), spec).training
    assert (training["algorithm"], training["block_size"], training["num_anchors"]) == ("dflash", 6, 64)
    assert training["num_draft_layers"] == cfg.drafter.num_draft_layers
    eagle = checkpoint.drafter_checkpoint(train_inputs(_cfg()), make_drafter().spec).training
    assert eagle["algorithm"] == "eagle" and not {"block_size", "num_anchors", "position_decay"} & eagle.keys()


def test_a_checkpoint_of_another_drafter_is_refused_in_one_line_naming_the_difference(tmp_path):
    """A resume whose checkpoint holds a drafter of another shape than the configured one (a DFlash run from before
    the draft vocabulary applied to DFlash: the whole vocab there, 24 ids now, under the same stage hash) is refused
    before DeepSpeed's load fails on a tensor's shape; the same drafter resumes."""
    from fledge.models.algorithms import DrafterSpec
    from fledge.models.drafter_checkpoint import DrafterCheckpoint
    from tests.helpers.models import DFLASH_TARGET, dflash_cfg

    ckpts = tmp_path / "train" / "checkpoints"
    whole = DrafterSpec.from_target_config(DFLASH_TARGET, dflash_cfg(block_size=4), [2, 4, 5])
    DrafterCheckpoint(whole, step=3).write(checkpoint.drafter_dir(ckpts, "step_00000003"), {})
    checkpoint.same_drafter(ckpts, "step_00000003", whole)
    vocab = DrafterSpec.from_target_config(DFLASH_TARGET, dflash_cfg(block_size=4, draft_vocab_size=24), [2, 4, 5])
    assert vocab != whole
    with pytest.raises(ValueError) as e:
        checkpoint.same_drafter(ckpts, "step_00000003", vocab)
    msg = str(e.value)
    assert "\n" not in msg and f"{ckpts / 'step_00000003'}: its drafter is not the configured one" in msg
    assert f"draft_vocab_size: {whole.draft_vocab_size!r} there, 24 now" in msg and f"move {ckpts.parent} aside" in msg
