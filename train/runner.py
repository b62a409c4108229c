"""The stage runner: prepare -> capture -> train -> export -> eval (train/stages.py), resumable by manifest.

Each stage writes ``<run_dir>/<stage>/manifest.json`` holding a hash of its inputs (its config slice,
the upstream manifests, code-relevant versions, a fingerprint of a local target). A stage whose
complete manifest matches is skipped, so re-running a command resumes. A stage whose inputs changed
starts over in a cleared directory, and since every downstream hash includes its upstream manifest,
the change cascades. An incomplete manifest with the same hash means "interrupted": the stage runs
again over its own partial output and is expected to resume it (capture keeps finished shards,
train loads its last checkpoint). A stage may also finish on purpose with part of its work done (one
slice of an array capture): its summary then holds ``"complete": False``, the manifest stays incomplete
and the stages after it do not run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fledge.conf.schema import STAGES, Config
from fledge.distributed import World, broadcast_object
from fledge.atomic import read_json, write_json_atomic
from fledge.models.target import target_fingerprint

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1

TRAIN_CADENCE = ("max_steps", "epochs", "grad_accum", "save_every", "keep_last", "eval_every", "eval_batches",
                 "log_every", "max_nonfinite")
ENGINE_KEYS = ("engine", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
UPSTREAM = {"prepare": None, "capture": "prepare", "train": "capture", "export": "train", "eval": "export"}


@dataclass
class StageContext:
    """What a stage receives: the typed config, where to write, and the upstream manifests."""

    cfg: Config
    world: World
    run_dir: Path
    stage_dir: Path
    upstream: dict[str, dict]  # stage name -> its complete manifest (all earlier stages present)

    def dir_of(self, stage: str) -> Path:
        return self.run_dir / stage


def config_slice(cfg: Config, stage: str) -> dict[str, Any]:
    """The config values a stage's output depends on (logging and later stages excluded)."""
    d = dataclasses.asdict
    target = {k: v for k, v in d(cfg.target).items() if k != "config_overrides"}  # prepare/capture load the model
    if stage == "prepare":
        return {"target": target, "data": d(cfg.data), "draft_vocab_size": cfg.drafter.draft_vocab_size,
                "seed": cfg.run.seed}
    if stage == "capture":
        # The slice fields are left out: the array tasks of one capture and its merge must agree on the
        # hash, or each would clear the others' output (and slicing does not change the store's content).
        cap = {k: v for k, v in d(cfg.capture).items() if k not in ("num_slices", "slice_index")}
        # The engine's python and patience do not change the store; with engine=hf none of the vLLM keys
        # exist for the hash, so HF stores keep the hash they had before capture.engine existed.
        drop = ("engine_python", "engine_timeout_s") + (ENGINE_KEYS if cfg.capture.engine == "hf" else ())
        cap = {k: v for k, v in cap.items() if k not in drop}
        return {"target": target, "capture": cap, "aux_layer_ids": cfg.aux_layer_ids()}
    if stage == "train":
        # Run length and cadence are left out: changing them (or grad_accum together with the world
        # size) continues from the last checkpoint instead of discarding the run.
        train = {k: v for k, v in d(cfg.train).items() if k not in TRAIN_CADENCE}
        return {"drafter": d(cfg.drafter), "train": train, "deepspeed": d(cfg.deepspeed),
                "capture_mode": cfg.capture.mode, "seed": cfg.run.seed}
    if stage == "export":
        # What export reads besides the checkpoint: the target's config (its local config.json, which the
        # fingerprint covers, else target.config_overrides, else the hub's: models/export.py
        # load_target_config), the target's name and the draft length (the speculators dialect writes both).
        return {"export": {k: v for k, v in d(cfg.export).items() if k not in ("push_to_hub", "private")},
                "target": d(cfg.target), "speculative_tokens": cfg.eval.draft_tokens}
    if stage == "eval":
        return {"eval": d(cfg.eval)}
    raise AssertionError(stage)


def inputs_hash(cfg: Config, stage: str, upstream: dict[str, dict]) -> str:
    import torch
    import transformers

    payload = {
        "schema": SCHEMA_VERSION,
        "stage": stage,
        "config": config_slice(cfg, stage),
        "upstream": {k: v["inputs_hash"] for k, v in upstream.items()},
        "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
    }
    if stage in ("prepare", "capture", "export"):
        payload["target_fingerprint"] = target_fingerprint(cfg.target.name_or_path)
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def run_stages(cfg: Config, world: World, stage_fns: dict[str, Callable[[StageContext], dict]]) -> dict[str, dict]:
    """Run the selected stages in pipeline order with ``stage_fns`` (train/stages.py's STAGES); return every
    stage's manifest that exists."""
    run_dir = Path(cfg.run.output_root) / cfg.run.name
    selected = [s for s in STAGES if s in cfg.run.stages]
    check_target_path(cfg.target.name_or_path)
    manifests: dict[str, dict] = {}
    for stage in STAGES:
        m = read_json(run_dir / stage / "manifest.json")
        if stage not in selected:
            if m and m.get("complete"):
                manifests[stage] = m
            continue
        up = UPSTREAM[stage]
        if up and up not in manifests and not _skippable_upstream(cfg, stage):
            raise ValueError(
                f"stage '{stage}' needs the output of '{up}', which is missing or incomplete in {run_dir}; "
                f"add it to run.stages (e.g. run.stages=[{up},{stage}])"
            )
        upstream = dict(manifests)
        h = inputs_hash(cfg, stage, upstream)
        stage_dir = run_dir / stage
        if m and m.get("complete") and m.get("inputs_hash") == h and stage not in cfg.run.force:
            log.info("stage %s: up to date (manifest %s), skipped", stage, h)
            manifests[stage] = m
            continue
        if world.is_main:
            if m and (m.get("inputs_hash") != h or stage in cfg.run.force):
                log.warning("stage %s: inputs changed (%s -> %s); starting it over", stage, m.get("inputs_hash"), h)
                shutil.rmtree(stage_dir, ignore_errors=True)
            stage_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(stage_dir / "manifest.json", {
                "stage": stage, "inputs_hash": h, "complete": False, "started": time.time()})
        world.barrier()
        log.info("stage %s: running -> %s", stage, stage_dir)
        t0 = time.time()
        outputs = stage_fns[stage](StageContext(cfg, world, run_dir, stage_dir, upstream)) or {}
        outputs = broadcast_object(outputs)  # rank 0's summary is the one recorded
        world.barrier()
        complete = outputs.pop("complete", True) is not False
        manifest = {"stage": stage, "inputs_hash": h, "complete": complete, "seconds": round(time.time() - t0, 1),
                    "outputs": outputs, "pid": os.getpid()}
        if not complete:
            manifest["partial"] = True
        if world.is_main:
            write_json_atomic(stage_dir / "manifest.json", manifest)
        world.barrier()
        if not complete:
            later = [s for s in selected if STAGES.index(s) > STAGES.index(stage)]
            log.warning("stage %s: partial output recorded, the stage stays incomplete%s", stage,
                        f"; not running {later}" if later else "")
            break
        manifests[stage] = manifest
        log.info("stage %s: done in %.1fs", stage, manifest["seconds"])
    return manifests


def check_target_path(name_or_path: str) -> None:
    """A target written as a path (absolute, or starting with . or ~) must exist before any stage runs;
    otherwise transformers reads it as a malformed hub id and fails deep inside a stage."""
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().is_dir():
        hint = ""
        if "tiny_target" in name_or_path:  # .cache/tiny_target/<budget> or <family>-<budget> (data/tiny_target.py)
            family, _, budget = Path(name_or_path).name.rpartition("-")
            hint = f" (build it with `fledge tiny-target --budget {budget}{f' --family {family}' if family else ''}`)"
        raise ValueError(f"target.name_or_path={name_or_path}: no such directory{hint}; give a model directory "
                         "or a hub id (org/name)")


def _skippable_upstream(cfg: Config, stage: str) -> bool:
    # Online training reads the target live: it needs prepare, not capture.
    return stage == "train" and cfg.capture.mode == "online"
