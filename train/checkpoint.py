"""Checkpoints: DeepSpeed state for exact resume, plus gathered drafter weights for export.

Layout under the train stage directory::

    checkpoints/<tag>/            DeepSpeed's files (model, ZeRO optimizer partitions, scheduler)
    checkpoints/<tag>/drafter/    model.safetensors (full state dict, ZeRO-3 shards gathered) + fledge.json
    checkpoints/<tag>/trainer.json  step, data position, best-so-far, world size (plain JSON, no pickle)
    checkpoints/<tag>_universal/  DeepSpeed's universal copy of <tag>, made to load it on another world
                                  size; not a checkpoint (pruning never counts it, and drops it once stale)
    checkpoints/latest            the tag of the newest *complete* checkpoint (written last, atomically)
    best/                         a copy of the best-by-eval drafter/ (AL estimate)

A checkpoint counts only once ``latest`` names it, so a kill during a save leaves the previous one.
Resuming on another world size goes through DeepSpeed's universal checkpoint format.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fledge.atomic import atomic_path, read_json, write_bytes_atomic, write_json_atomic
from fledge.distributed import World

log = logging.getLogger(__name__)
TAG = re.compile(r"step_\d{8}")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def latest_tag(ckpt_dir: Path) -> str | None:
    p = ckpt_dir / "latest"
    if not p.exists():
        return None
    tag = p.read_text().strip()
    if not (ckpt_dir / tag / "trainer.json").exists():
        raise ValueError(f"{p} names {tag!r}, which has no trainer.json; delete {p} to start training over")
    return tag


def trainer_state(ckpt_dir: Path, tag: str) -> dict:
    state = read_json(ckpt_dir / tag / "trainer.json")
    assert state is not None
    return state


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """The module's full state dict on every rank (ZeRO-3 partitions gathered; a collective)."""
    module = engine.module
    if engine.zero_optimization_partition_weights():
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def save(engine, world: World, ckpt_dir: Path, step: int, state: dict[str, Any], drafter_meta: dict[str, Any],
         prefix: str, keep_last: int) -> Path:
    """Save a resumable checkpoint at ``step``; returns the drafter weights directory. All ranks call."""
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"universal_checkpoint_info": {}},
                           save_latest=False)
    weights = gathered_state_dict(engine)
    drafter_dir = ckpt_dir / tag / "drafter"
    if world.is_main:
        tensors = {k[len(prefix):]: v.contiguous() for k, v in weights.items() if k.startswith(prefix)}
        with atomic_path(drafter_dir) as tmp:
            tmp.mkdir(parents=True)
            save_file(tensors, str(tmp / "model.safetensors"))
            write_json_atomic(tmp / "fledge.json", {**drafter_meta, "step": step})
        write_json_atomic(ckpt_dir / tag / "trainer.json", {**state, "step": step, "world_size": world.world_size})
        write_bytes_atomic(ckpt_dir / "latest", tag.encode())
        _prune(ckpt_dir, keep_last)
    world.barrier()
    log.info("checkpoint %s saved", tag)
    return drafter_dir


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


def promote_best(drafter_dir: Path, best_dir: Path) -> None:
    """Copy a checkpoint's drafter weights to best/ (rank 0), atomically."""
    with atomic_path(best_dir) as tmp:
        shutil.copytree(drafter_dir, tmp)


def to_universal(ckpt_dir: Path, tag: str, world: World) -> str:
    """Convert a checkpoint to DeepSpeed's universal format (once; rank 0) and return its tag."""
    utag = f"{tag}_universal"
    if world.is_main and not (ckpt_dir / utag / "done").exists():
        log.info("world size changed: converting %s to a universal checkpoint", tag)
        shutil.rmtree(ckpt_dir / utag, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(ckpt_dir / tag), "--output_folder", str(ckpt_dir / utag), "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed on {ckpt_dir / tag}:\n{res.stderr[-3000:]}")
        (ckpt_dir / utag / "done").write_text("ok\n")
    world.barrier()
    return utag
