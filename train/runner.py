"""The stage runner: prepare -> capture -> train -> export -> eval -> publish (train/pipeline.py), resumable by
manifest.

Each stage writes ``<run_dir>/<stage>/manifest.json``: its inputs (its config slice, the upstream stages'
inputs hashes, code-relevant versions, a fingerprint of a local target) and their hash, the ids of the
upstream outputs it read, and once complete its summary and a fresh id of its own output. Before any stage
runs, each selected stage is planned against its manifest:

- same inputs, same upstream outputs: a complete stage is skipped when its ``Stage.done`` finds nothing
  more asked of it (train: the steps asked were reached), else it runs again over its own output, as an
  interrupted stage does (capture keeps its finished shards, train trains on from its last checkpoint);
- something changed, in a stage rebuilt from its upstream in minutes (``Stage.rebuild``: export, eval,
  publish): it starts over in a cleared directory;
- something changed, in a stage whose output is costly (prepare, capture, train): nothing runs and one
  line names what changed, old -> new, and the two ways on: ``run.force=[stage]`` starts it over, a new
  ``run.name`` starts another run beside it. Nothing is deleted unless the user asked.

Keys that only change how the work is laid out are not inputs: train.sequence_parallel, train.grad_accum
and the world size (``LAYOUT_KEYS``; the trainer resumes at the global batches consumed, and warns when the
optimizer step's size changes); nor are run length and cadence (train.max_steps, save_every, ...; ``Stage.done`` handles the length). ``run.force=[X]``
clears X and runs it; its output is then new, so the stages after it see a changed input: the rebuildable
ones rebuild, a costly one stops the run before anything runs unless it is forced too. A complete stage
that is not selected and read an upstream output that has since been replaced is out of date: later
stages do not use it. A stage may finish on purpose with part of its work done (one slice of an array
capture): its summary then holds ``"complete": False``, the manifest stays incomplete and the stages
after it do not run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from fledge.conf.schema import STAGES, Config
from fledge.distributed import World, broadcast_object
from fledge.atomic import read_json, write_json_atomic
from fledge.models.target import target_fingerprint

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1

TRAIN_CADENCE = ("max_steps", "epochs", "save_every", "keep_last", "eval_every", "eval_batches", "log_every",
                 "max_nonfinite")
# How the work is laid out over ranks (tests/distributed/test_train.py checks each on a resumed run): the rows
# split over a sequence-parallel group, and the optimizer step made of grad_accum micro-batches on each
# data-parallel rank. A run resumes at the global batches it consumed on any world size x grad_accum; a step
# of another size is the trainer's warning (train/trainer.py), not a new run: a requeued job on fewer nodes
# must be able to go on.
LAYOUT_KEYS = ("sequence_parallel", "grad_accum")
PUBLISH_KEYS = ("push_to_hub", "repo_id", "private")  # the publish stage's inputs; the export stage's are the rest
ENGINE_KEYS = ("engine", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
UPSTREAM = {"prepare": None, "capture": "prepare", "train": "capture", "export": "train", "eval": "export",
            "publish": "eval"}
# Slice entries whose name is not their config key (kept so that those stages' hashes stay as they were).
SLICE_KEYS = {"draft_vocab_size": "drafter.draft_vocab_size", "seed": "run.seed",
              "aux_layer_ids": "drafter.aux_layer_ids", "speculative_tokens": "eval.draft_tokens"}


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


class Refused(ValueError):
    """The run cannot go on as configured (one line, the same on every rank: rank 0 decided)."""


def _always_done(manifest: dict, cfg: Config) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    """A pipeline stage as the runner sees it: the work, and how its output is treated."""

    run: Callable[[StageContext], dict]
    # Its output is rebuilt from upstream in minutes: a changed input starts it over instead of stopping.
    rebuild: bool = False
    # Given its complete manifest and this config: True = nothing more to do; False = run again over the
    # output (train asked for more steps); a ValueError = the config asks what this output cannot give.
    done: Callable[[dict, Config], bool] = _always_done


def config_slice(cfg: Config, stage: str) -> dict[str, Any]:
    """The config values a stage's output depends on (logging, layout and later stages excluded)."""
    d = dataclasses.asdict
    target = {k: v for k, v in d(cfg.target).items() if k != "config_overrides"}  # prepare/capture load the model
    if stage == "prepare":
        return {"target": target, "data": d(cfg.data), "draft_vocab_size": cfg.drafter.draft_vocab_size,
                "seed": cfg.run.seed}
    if stage == "capture":
        # The slice fields are left out: the array tasks of one capture and its merge must agree on the
        # hash (and slicing does not change the store's content).
        cap = {k: v for k, v in d(cfg.capture).items() if k not in ("num_slices", "slice_index")}
        # The engine's python and patience do not change the store; with engine=hf none of the vLLM keys
        # exist for the hash, so HF stores keep the hash they had before capture.engine existed.
        drop = ("engine_python", "engine_timeout_s") + (ENGINE_KEYS if cfg.capture.engine == "hf" else ())
        cap = {k: v for k, v in cap.items() if k not in drop}
        return {"target": target, "capture": cap, "aux_layer_ids": cfg.aux_layer_ids()}
    if stage == "train":
        train = {k: v for k, v in d(cfg.train).items() if k not in TRAIN_CADENCE + LAYOUT_KEYS}
        return {"drafter": d(cfg.drafter), "train": train, "deepspeed": d(cfg.deepspeed),
                "capture": {"mode": cfg.capture.mode}, "run": {"seed": cfg.run.seed}}
    if stage == "export":
        # What export reads besides the checkpoint: the target's config (its local config.json, which the
        # fingerprint covers, else target.config_overrides, else the hub's: serving/export.py
        # load_target_config), the target's name and the draft length (the speculators dialect writes both).
        return {"export": {k: v for k, v in d(cfg.export).items() if k not in PUBLISH_KEYS},
                "target": d(cfg.target), "speculative_tokens": cfg.eval.draft_tokens}
    if stage == "eval":
        return {"eval": d(cfg.eval)}
    if stage == "publish":
        return {"export": {k: getattr(cfg.export, k) for k in PUBLISH_KEYS}}
    raise AssertionError(stage)


def stage_inputs(cfg: Config, stage: str, upstream_hashes: dict[str, str]) -> dict:
    """Everything a stage's output depends on, as stored in its manifest (``inputs``) and hashed."""
    import torch
    import transformers

    payload = {
        "schema": SCHEMA_VERSION,
        "stage": stage,
        "config": config_slice(cfg, stage),
        "upstream": dict(upstream_hashes),
        "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
    }
    if stage in ("prepare", "capture", "export"):
        payload["target_fingerprint"] = target_fingerprint(cfg.target.name_or_path)
    return payload


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


def inputs_hash(cfg: Config, stage: str, upstream: dict[str, dict]) -> str:
    """The hash of a stage's inputs given the upstream manifests."""
    return digest(stage_inputs(cfg, stage, {k: v["inputs_hash"] for k, v in upstream.items()}))


NEW = None  # the output id of a stage this command runs: not known until it completes


@dataclass
class _Plan:
    action: str  # use (not selected: its output is read) | skip | run (fresh) | resume (over its output) | start over
    inputs: dict
    inputs_hash: str
    why: str = ""  # for the log: what changed, or what more was asked


def run_stages(cfg: Config, world: World, stages: dict[str, Stage]) -> dict[str, dict]:
    """Run the selected stages in pipeline order (``stages``: train/pipeline.py's STAGES); return the manifest
    of every stage that is complete and current, each with ``action``: what this command did with it."""
    from fledge.train.preflight import check_target_path

    run_dir = Path(cfg.run.output_root) / cfg.run.name
    check_target_path(cfg.target.name_or_path)
    # Rank 0 reads the manifests and decides for all, before any is written; its refusal reaches every rank.
    decided: dict[str, Any] = {}
    if world.is_main:
        old = {s: read_json(run_dir / s / "manifest.json") for s in STAGES}
        try:
            decided = {"old": old, "plans": plan_stages(cfg, stages, old)}
        except ValueError as e:
            decided = {"error": str(e)}
    decided = broadcast_object(decided)
    if "error" in decided:
        raise Refused(decided["error"])
    old, plans = decided["old"], decided["plans"]
    manifests: dict[str, dict] = {}  # the complete manifests later stages read
    result: dict[str, dict] = {}
    for stage, plan in plans.items():
        if plan.action in ("use", "skip"):
            if plan.action == "skip":
                log.info("stage %s: up to date (manifest %s), skipped", stage, plan.inputs_hash)
            manifests[stage] = old[stage]
            result[stage] = {**old[stage], "action": plan.action}
            continue
        stage_dir = run_dir / stage
        read = {k: output_id(v) for k, v in manifests.items()}
        if world.is_main:
            if plan.action == "start over" and stage_dir.exists():
                log.warning("stage %s: %s; starting it over", stage, plan.why)
                shutil.rmtree(stage_dir)
            elif plan.why:
                log.info("stage %s: %s", stage, plan.why)
            stage_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(stage_dir / "manifest.json", {
                "stage": stage, "inputs_hash": plan.inputs_hash, "complete": False, "started": time.time(),
                "inputs": plan.inputs, "read": read})
        world.barrier()
        log.info("stage %s: running -> %s", stage, stage_dir)
        t0 = time.time()
        outputs = stages[stage].run(StageContext(cfg, world, run_dir, stage_dir, dict(manifests))) or {}
        outputs, new_id = broadcast_object((outputs, uuid.uuid4().hex))  # rank 0's summary and id are recorded
        world.barrier()
        complete = outputs.pop("complete", True) is not False
        manifest = {"stage": stage, "inputs_hash": plan.inputs_hash, "complete": complete,
                    "seconds": round(time.time() - t0, 1), "outputs": outputs, "pid": os.getpid(),
                    "inputs": plan.inputs, "read": read}
        if complete:
            manifest["output_id"] = new_id
        else:
            manifest["partial"] = True
        if world.is_main:
            write_json_atomic(stage_dir / "manifest.json", manifest)
        world.barrier()
        if not complete:
            later = [s for s, p in plans.items() if STAGES.index(s) > STAGES.index(stage) and p.action != "use"]
            log.warning("stage %s: partial output recorded, the stage stays incomplete%s", stage,
                        f"; not running {later}" if later else "")
            break
        manifests[stage] = manifest
        result[stage] = {**manifest, "action": plan.action}
        log.info("stage %s: done in %.1fs", stage, manifest["seconds"])
    return result


def output_id(manifest: dict) -> str:
    """The id of a complete stage's output ("" for manifests from before output ids)."""
    return manifest.get("output_id", "")


def plan_stages(cfg: Config, stages: dict[str, Stage], old: dict[str, Optional[dict]]
                ) -> dict[str, _Plan]:
    """Decide for every stage, before any runs, whether it is used as it is, skipped, run over its output or
    started over (the stages neither selected nor usable are left out); a change that would discard a
    costly output raises ValueError (one line) instead."""
    ahead: dict[str, tuple[str, Optional[str]]] = {}  # stage -> (inputs hash, output id) later stages read
    plans: dict[str, _Plan] = {}
    for stage in STAGES:
        m = old[stage]
        if stage not in cfg.run.stages:
            read = (m or {}).get("read") or {}
            if m and m.get("complete") and all(k in ahead and ahead[k][1] == v for k, v in read.items()):
                plans[stage] = _Plan("use", m.get("inputs") or {}, m["inputs_hash"])
                ahead[stage] = (m["inputs_hash"], output_id(m))
            continue
        up = UPSTREAM[stage]
        if up and up not in ahead and not _skippable_upstream(cfg, stage):
            raise ValueError(
                f"stage '{stage}' needs the output of '{up}', which is missing, incomplete or out of date (a stage "
                f"before it ran again) in {Path(cfg.run.output_root) / cfg.run.name}; add it to run.stages "
                f"(e.g. run.stages=[{up},{stage}])")
        inputs = stage_inputs(cfg, stage, {k: h for k, (h, _) in ahead.items()})
        h = digest(inputs)
        plan = _plan(cfg, stage, stages[stage], m, inputs, h, {k: out for k, (_, out) in ahead.items()})
        plans[stage] = plan
        ahead[stage] = (h, output_id(m) if plan.action == "skip" else NEW)
    return plans


def _plan(cfg: Config, stage: str, spec: Stage, m: Optional[dict], inputs: dict, h: str,
          read: dict[str, Optional[str]]) -> _Plan:
    if stage in cfg.run.force:
        return _Plan("start over", inputs, h, f"run.force=[{stage}]")
    if not m:
        return _Plan("run", inputs, h)
    same = (h, hash_before_layout_keys(cfg, inputs)) if "inputs" not in m else (h,)
    changes = describe_changes(m, inputs, h, read, cfg.run.force, same)
    if changes:
        if spec.rebuild:
            return _Plan("start over", inputs, h, f"inputs changed ({changes})")
        force = ",".join(s for s in STAGES if s in cfg.run.force or s == stage)
        raise ValueError(f"{stage}: its inputs changed since it ran ({changes}); its output is kept: "
                         f"run.force=[{force}] starts {stage} over on them (deleting that output), or a new "
                         "run.name starts a separate run")
    if not m.get("complete"):
        return _Plan("resume", inputs, h, "incomplete: running it again over its own output")
    if spec.done(m, cfg):
        return _Plan("skip", inputs, h)
    return _Plan("resume", inputs, h, "complete, and this config asks for more: running it again over its output")


def describe_changes(m: dict, inputs: dict, h: str, read: dict[str, Optional[str]], force: list[str],
                     same: tuple[str, ...] = ()) -> str:
    """What differs between a stage's manifest and its inputs now, as 'what: old -> new; ...' ("" if nothing):
    upstream outputs made by this command or replaced since, then changed config keys, versions, target.
    ``same``: the hashes that count as unchanged inputs (default: ``h``)."""
    out, replaced = [], set()
    for stage, now in read.items():
        if now is NEW:
            out.append(f"{stage}'s output: {'starts over' if stage in force else 'runs again'} in this command")
        elif "read" in m and m["read"].get(stage) != now:
            out.append(f"{stage}'s output: replaced since this stage ran")
        else:
            continue
        replaced.add(f"upstream.{stage}")
    if m.get("inputs_hash") not in (same or (h,)):
        if "inputs" not in m:  # written before manifests kept their inputs
            out.append(f"its manifest, from an older Fledge, keeps only a hash of them ({m.get('inputs_hash')} -> "
                       f"{h}): the config, a library version or what Fledge counts as an input changed")
        else:
            was, now_ = dict(_flatten(m["inputs"])), dict(_flatten(json.loads(json.dumps(inputs, default=str))))
            out += [f"{_key_name(k)}: {_short(was.get(k, '(absent)'))} -> {_short(now_.get(k, '(absent)'))}"
                    for k in sorted(was.keys() | now_.keys()) if was.get(k) != now_.get(k) and k not in replaced]
    return "; ".join(out)


def hash_before_layout_keys(cfg: Config, inputs: dict) -> str:
    """The hash a train stage's manifest got before LAYOUT_KEYS existed (grad_accum was cadence then,
    sequence_parallel an input, the global batch not one), so that a train run from then trains on."""
    if inputs["stage"] != "train":
        return ""
    c = inputs["config"]
    train = {**c["train"], "sequence_parallel": cfg.train.sequence_parallel}
    return digest({**inputs, "config": {"drafter": c["drafter"], "train": train, "deepspeed": c["deepspeed"],
                                        "capture_mode": c["capture"]["mode"], "seed": c["run"]["seed"]}})


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _key_name(key: str) -> str:
    """A payload key as the user knows it: the config key, or what it stands for."""
    if key.startswith("config."):
        key = key[len("config."):]
        return SLICE_KEYS.get(key, key)
    if key == "target_fingerprint":
        return "the target's files (target.name_or_path)"
    if key.startswith("upstream."):
        return f"{key[len('upstream.'):]}'s inputs"
    return key  # versions.torch, versions.transformers, schema


def _short(v: Any, width: int = 60) -> str:
    s = json.dumps(v, sort_keys=True, default=str) if not isinstance(v, str) else v
    return s if len(s) <= width else s[: width - 3] + "..."


def _skippable_upstream(cfg: Config, stage: str) -> bool:
    # Online training reads the target live: it needs prepare, not capture.
    return stage == "train" and cfg.capture.mode == "online"
