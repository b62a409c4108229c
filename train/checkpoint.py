"""Checkpoints: DeepSpeed state for exact resume, plus gathered drafter weights for export.

Layout under the train stage directory::

    checkpoints/step_<N>/         DeepSpeed's files (model, ZeRO optimizer partitions, lr scheduler)
    checkpoints/step_<N>/drafter/ the drafter checkpoint (models/drafter_checkpoint.py; ZeRO-3 shards gathered)
    checkpoints/step_<N>/trainer.json  plain JSON (no pickle): ``step`` (optimizer steps done), ``batches``
                                  (global batches consumed: the data position), ``batches_per_step``,
                                  ``schedule`` (the lr schedule's end step, its step count, where its decay
                                  started), best-so-far, skipped steps, ``world_size``
    checkpoints/step_<N>_universal/  DeepSpeed's universal copy of step_<N>, made to load it on another world
                                  size; not a checkpoint (pruning never counts it, and drops it once stale)
    checkpoints/latest            the tag of the newest *complete* checkpoint (written last, atomically)
    best/                         a copy of the best-by-eval drafter/ (AL estimate)

A checkpoint counts only once ``latest`` names it, so a kill during a save leaves the previous one.
A resume on any world size and gradient accumulation continues at the stored data position
(:func:`resume_plan`), the model and optimizer through DeepSpeed's universal format when the world changed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fledge.atomic import atomic_path, read_json, write_bytes_atomic, write_json_atomic
from fledge.conf.schema import OptimConfig, TrainConfig
from fledge.distributed import World
from fledge.models.algorithms import DrafterSpec, algorithm_of
from fledge.models.drafter_checkpoint import META, DrafterCheckpoint
from fledge.stage_inputs import TrainInputs
from fledge.train.deepspeed_setup import decay_progress, lr_lambda

log = logging.getLogger(__name__)
TAG = re.compile(r"step_\d{8}")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def drafter_dir(ckpt_dir: Path, tag: str) -> Path:
    """Where checkpoint ``tag`` keeps its drafter checkpoint (what export reads)."""
    return ckpt_dir / tag / "drafter"


def drafter_checkpoint(inputs: TrainInputs, spec: DrafterSpec) -> DrafterCheckpoint:
    """What each checkpoint says of the drafter with ``spec`` besides its weights: the target, and how it
    was trained (its step is filled in at each save)."""
    d = inputs.drafter
    return DrafterCheckpoint(
        spec, target={"name_or_path": inputs.target.name_or_path, "revision": inputs.target.revision},
        training={"recipe": inputs.recipe, "loss": d.loss, "ttt_steps": d.ttt_steps, "step_weight": d.step_weight,
                  "fc_norm": d.fc_norm, "norm_output": d.norm_output, "norm_before_fc": d.norm_before_fc,
                  "parallel_drafting": d.parallel_drafting, "algorithm": d.algorithm,
                  **({"block_size": d.block_size, "num_anchors": d.num_anchors, "position_decay": d.position_decay,
                      "num_draft_layers": d.num_draft_layers} if algorithm_of(spec).block else {}),
                  "train": dataclasses.asdict(inputs.train)})


def latest_tag(ckpt_dir: Path) -> str | None:
    p = ckpt_dir / "latest"
    if not p.exists():
        return None
    tag = p.read_text().strip()
    if not (ckpt_dir / tag / "trainer.json").exists():
        raise ValueError(f"{p} names {tag!r}, which has no trainer.json; delete {p} to start training over")
    return tag


def same_drafter(ckpt_dir: Path, tag: str, spec: DrafterSpec) -> None:
    """Refuse to resume checkpoint ``tag`` when its drafter is not the one configured: a checkpoint written by a
    Fledge whose spec read a key otherwise (a DFlash run from before ``drafter.draft_vocab_size`` applied to it) has
    the same stage hash, and DeepSpeed's load would fail on a tensor's shape. ValueError naming what differs."""
    saved = DrafterCheckpoint.read(drafter_dir(ckpt_dir, tag)).spec
    if saved == spec:
        return
    a, b = saved.to_dict(), spec.to_dict()
    diff = "; ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in sorted(a.keys() | b.keys())
                     if a.get(k) != b.get(k))
    raise ValueError(f"{ckpt_dir / tag}: its drafter is not the configured one ({diff or type(saved).__name__}); "
                     f"move {ckpt_dir.parent} aside to train afresh, or configure the checkpoint's drafter to resume")


def trainer_state(ckpt_dir: Path, tag: str) -> dict:
    state = read_json(ckpt_dir / tag / "trainer.json")
    assert state is not None
    return state


@dataclass
class ResumePlan:
    """Where a run starts: ``step`` optimizer steps done, ``batches`` global batches consumed (the loaders'
    position), ``total`` the step the run ends at, ``decay_from`` the lr decay's start (train/deepspeed_setup.py
    ``decay_progress``; None: the end of warmup)."""

    step: int
    batches: int
    total: int
    decay_from: tuple[int, float] | None
    note: str | None = None  # for the resume message: the lr schedule was re-spanned (schedule_note)


def planned_steps(max_steps: int, epochs: int, step: int, batches: int, per_step: int, batches_per_epoch: int) -> int:
    """The optimizer step a run ends at, from where it is (``step`` steps done, ``batches`` global batches
    consumed) and today's step size ``per_step``: ``max_steps`` counts optimizer steps, whatever their size;
    ``epochs`` (with max_steps 0) counts data, so the steps left are the whole steps the batches left make.
    The one rule for the trainer's resume and the runner's "is this run long enough" (pipeline/stages.py)."""
    if max_steps:
        return max_steps
    return max(1, step + max(0, epochs * batches_per_epoch - batches) // per_step)


def resume_plan(state: dict, t: TrainConfig, per_step: int, batches_per_epoch: int) -> ResumePlan:
    """The plan for a run whose last checkpoint's trainer.json is ``state`` ({} for a fresh run), taking
    ``per_step`` global batches per optimizer step now (grad_accum x data-parallel ranks), whatever the
    checkpoint's step size was.

    ``train.max_steps`` counts optimizer steps, whatever their size. ``train.epochs`` counts data: the run
    ends when ``epochs`` x ``batches_per_epoch`` global batches are consumed, so after a change of step size
    the steps left are the batches left at the new size, and the lr decay goes on from where it was to the
    new end (DeepSpeed restores the scheduler's step count; its end is the run's). ``t``: the train section."""
    step = int(state.get("step", 0))
    # a trainer.json from before the data position was stored: assume today's step size, as resumes did then
    batches = int(state.get("batches", step * per_step))
    total = planned_steps(t.max_steps, t.epochs, step, batches, per_step, batches_per_epoch)
    saved = state.get("schedule")
    decay_from = tuple(saved["decay_from"]) if saved and saved["decay_from"] else None
    moved = bool(saved) and total != saved["total"] and per_step != state["batches_per_step"]
    if moved and saved["count"] >= t.optim.warmup_steps:  # (during warmup the decay has not started)
        decay_from = (saved["count"], decay_progress(t.optim, saved["total"], saved["count"], decay_from))
    note = schedule_note(t.optim, saved, total, decay_from, step) if saved else None
    return ResumePlan(step, batches, total, decay_from, note)


def schedule_note(o: OptimConfig, saved: dict, total: int, decay_from: tuple[int, float] | None,
                  step: int) -> str | None:
    """What the resume message says when a longer (or shorter) run re-spans the lr schedule over its new length
    (docs/architecture.md, Resuming and changing a run): the steps trained ran under the old span, and the lr
    jumps at the resume (a finished cosine run's floor rises back up the curve). Kept deliberately: extending
    the old schedule instead would train every added step at its final lr (``min_lr_ratio`` x lr, 0 by default).
    None when the lr goes on as it was (same end, a constant schedule, the decay carried over a step size change)."""
    count, lr = saved["count"], o.lr
    old_decay = tuple(saved["decay_from"]) if saved["decay_from"] else None
    before = lr * lr_lambda(o, saved["total"], old_decay)(count)
    after = lr * lr_lambda(o, total, decay_from)(count)
    if math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-12 * lr):
        return None
    return (f"train: the lr schedule ended at step {saved['total']} and the run now ends at step {total} "
            "(train.max_steps / train.epochs changed): the train.optim.schedule="
            f"{o.schedule} decay is recomputed over the new length, so the lr at step {count} goes "
            f"from {before:.3g} to {after:.3g}; the {step} steps trained so far ran under the {saved['total']}-step "
            "schedule (run.force=[train] trains the whole run under one)")


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """The module's full state dict on every rank (ZeRO-3 partitions gathered; a collective)."""
    module = engine.module
    if engine.zero_optimization_partition_weights():
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def save(engine, world: World, ckpt_dir: Path, step: int, state: dict[str, Any], drafter: DrafterCheckpoint,
         prefix: str, keep_last: int) -> Path:
    """Save a resumable checkpoint at ``step`` (``drafter``: :func:`drafter_checkpoint`'s, the module's
    drafter under ``prefix``); returns its drafter checkpoint directory. All ranks call."""
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"universal_checkpoint_info": {}},
                           save_latest=False)
    weights = gathered_state_dict(engine)
    out = drafter_dir(ckpt_dir, tag)
    if world.is_main:
        drafter.at_step(step).write(out, {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
        write_json_atomic(ckpt_dir / tag / "trainer.json", {**state, "step": step, "world_size": world.world_size})
        write_bytes_atomic(ckpt_dir / "latest", tag.encode())
        _prune(ckpt_dir, keep_last)
    world.barrier()
    log.info("checkpoint %s saved", tag)
    return out


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to the one ``latest`` names (a later tag is a save cut
    short, which the run overwrites when it gets there). Universal copies are not checkpoints: each served
    one load of its source, so all but the latest's are dropped."""
    latest = (ckpt_dir / "latest").read_text().strip()
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG.fullmatch(p.name) and p.name <= latest)
    for old in tags[: max(0, len(tags) - max(1, keep_last))]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    for copy in ckpt_dir.glob("step_*_universal"):
        if copy.name != f"{latest}_universal":
            shutil.rmtree(copy, ignore_errors=True)


def promote_best(drafter: Path, best_dir: Path) -> None:
    """Copy a checkpoint's drafter checkpoint to best/ (rank 0), atomically."""
    with atomic_path(best_dir, "drafter-checkpoint") as tmp:
        shutil.copytree(drafter, tmp)


def best_follows_state(ckpt_dir: Path, state: dict, best_dir: Path) -> None:
    """best/ holds the drafter of the checkpoint's best step (rank 0, at a resume). A save that finds a new best
    writes the checkpoint, ``latest`` naming it, and only then copies its drafter to best/: a run killed between
    the two resumes with a state whose best is that step and a best/ that is still the one before (which export
    and the manifest's ``best`` would then serve as the best); the copy is made now, from that checkpoint."""
    step = state.get("best_step")
    src = drafter_dir(ckpt_dir, tag_for(step)) if step is not None else None
    if src is None or not src.is_dir():  # no best yet, or one promoted before a later checkpoint was saved
        return
    held = DrafterCheckpoint.read(best_dir).step if (best_dir / META).is_file() else None
    if held != step:
        log.warning("train: %s holds the drafter of step %s, the checkpoint's best is step %d (a run stopped between "
                    "the two): copying it there", best_dir, held, step)
        promote_best(src, best_dir)


def to_universal(ckpt_dir: Path, tag: str, world: World, optim: OptimConfig) -> str:
    """Convert a checkpoint to DeepSpeed's universal format (once; rank 0) and return its tag. ``optim``: the
    run's ``train.optim``; Muon's momentum is no state the conversion knows (it carries Adam's), so a Muon run's
    checkpoint is refused, naming the world size that resumes it."""
    if optim.name == "muon":
        saved = trainer_state(ckpt_dir, tag).get("world_size")
        raise ValueError(f"train: checkpoint {ckpt_dir / tag} was saved on {saved} ranks and this world has "
                         f"{world.world_size}; a train.optim.name=muon checkpoint loads on the world size that saved "
                         "it only (DeepSpeed's universal checkpoint carries Adam's states, not Muon's momentum): "
                         f"resume on {saved} ranks, or start training over with run.force=[train]")
    utag = f"{tag}_universal"
    if world.is_main and not (ckpt_dir / utag / "done").exists():
        log.info("world size changed: converting %s to a universal checkpoint", tag)
        shutil.rmtree(ckpt_dir / utag, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(ckpt_dir / tag), "--output_folder", str(ckpt_dir / utag), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ValueError(_conversion_failed(ckpt_dir, tag, world.world_size, res.stdout + res.stderr))
        (ckpt_dir / utag / "done").write_text("ok\n")
    world.barrier()
    return utag


def _conversion_failed(ckpt_dir: Path, tag: str, world_size: int, output: str) -> str:
    """The message for a checkpoint ds_to_universal could not convert (a damaged checkpoint, or one this
    DeepSpeed cannot convert): what failed, where its output is, and the ways on that need no conversion.
    The half-written conversion is removed; the checkpoint itself is left as it is."""
    shutil.rmtree(ckpt_dir / f"{tag}_universal", ignore_errors=True)
    log_path = ckpt_dir.parent / "ds_to_universal.log"
    log_path.write_text(output)
    saved = trainer_state(ckpt_dir, tag).get("world_size")
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
    earlier = [p.name for p in sorted(ckpt_dir.glob("step_*")) if p.name < tag and not p.name.endswith("_universal")
               and (p / "trainer.json").exists()]
    ways = [f"resume on {saved} ranks, where no conversion is needed"]
    if earlier:
        ways.append(f"resume from the checkpoint before it by writing {earlier[-1]} into {ckpt_dir / 'latest'}")
    ways.append("start training over with run.force=[train]")
    return (f"train: DeepSpeed's ds_to_universal could not convert checkpoint {ckpt_dir / tag} (saved on {saved} "
            f"ranks) for this world of {world_size}: {last} (its output: {log_path}). Either " + "; or ".join(ways))
