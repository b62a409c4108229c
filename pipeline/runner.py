"""The stage runner: the pipeline's stages (pipeline/stages.py, one :class:`Stage` record each) in order,
resumable by manifest.

Each stage writes its manifest (fledge/run_layout.py): its inputs (the hashed fields of its stage inputs, the
upstream stages' inputs hashes, code-relevant versions, a fingerprint of a local target) and their hash, the ids
of the upstream outputs it read, and once complete its summary and a fresh id of its own output. Before any stage
runs, each selected stage is planned against its manifest:

- same inputs, same upstream outputs: a complete stage is skipped when its ``Stage.done`` finds nothing
  more asked of it (train: the steps asked were reached), else it runs again over its own output, as an
  interrupted stage does (capture keeps its finished shards, train trains on from its last checkpoint);
- something changed, in a stage rebuilt from its upstream in minutes (``Stage.rebuild``: export, eval,
  publish): it starts over in a cleared directory;
- something changed, in a stage whose output is costly (prepare, capture, train): nothing runs and one
  line names what changed, old -> new, and the two ways on: ``run.force=[stage]`` starts it over, a new
  ``run.name`` starts another run beside it. Nothing is deleted unless the user asked, and never a directory
  that is not this run's (fledge/owned.py: a stage directory of someone else's files is refused before any runs);
- only an upgrade changed it (library versions, a config key the older Fledge did not record, at the schema's
  default): its output is kept and used as if unchanged, with a warning, and its manifest records the new inputs.

What counts as an input is what each record's builder makes of the config (``Stage.inputs``: the stage's
dataclass of fledge/stage_inputs.py): the stage receives exactly that, and its hashed fields are hashed
(``stage_inputs.hashed``; fields that only lay the work out, run length and cadence are runtime;
``Stage.done`` handles the length). ``run.force=[X]``
clears X and runs it; its output is then new, so the stages after it see a changed input: the rebuildable
ones rebuild, a costly one stops the run before anything runs unless it is forced too. A complete stage
that is not selected and read an upstream output that has since been replaced is out of date: later
stages do not use it. A stage may finish on purpose with part of its work done (one slice of an array
capture): its summary then holds ``"complete": False``, the manifest stays incomplete and the stages after
it do not run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fledge.atomic import read_json, write_json_atomic
from fledge.conf.schema import Config
from fledge.distributed import World, broadcast_object
from fledge.models.target import target_fingerprint
from fledge.owned import check_replaceable, remove_owned
from fledge.pipeline.preflight import check_target_path
from fledge.run_layout import RunLayout
from fledge.stage_context import StageContext
from fledge.stage_inputs import StageInputs, hashed

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
STAGE_FIX = "move those files away, or pick another run.name or run.output_root (nothing was deleted)"


def _always(inputs: StageInputs) -> bool:
    return True


def _always_done(manifest: dict, inputs: StageInputs) -> bool:
    return True


def _no_check(inputs: StageInputs) -> None:
    return None


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, as everything that handles stages reads it: the runner plans, hashes and runs it
    from this record, the schema's stage list is held to the records (tests/unit/pipeline/test_stages.py).

    ``inputs(cfg)``: what it reads of the config (its dataclass of fledge/stage_inputs.py): it receives that,
    and its hashed fields are hashed with the upstream hashes and versions. The hooks below are given the same
    inputs. ``upstream``: the stage whose output it reads (None for the first);
    ``needs_upstream(inputs)`` False when these inputs do without it (online training reads the target live,
    not capture's store). ``rebuild``: its output is rebuilt from upstream in minutes, so a changed input
    starts it over instead of stopping the run. ``done(manifest, inputs)``: given its complete manifest, True
    = nothing more to do, False = run again over its output (train asked for more steps), a ValueError = the
    config asks what this output cannot give. ``target_files``: the target's local files are an input.
    ``check(inputs)``: what must hold before it runs (a missing input file), called only when it will run."""

    name: str
    run: Callable[[StageContext], dict]
    inputs: Callable[[Config], StageInputs]
    upstream: str | None = None
    needs_upstream: Callable[[Any], bool] = _always
    rebuild: bool = False
    done: Callable[[dict, Any], bool] = _always_done
    target_files: bool = False
    check: Callable[[Any], None] = _no_check


class Refused(ValueError):
    """The run cannot go on as configured (one line, the same on every rank: rank 0 decided)."""


def stage_inputs(cfg: Config, stage: Stage, upstream_hashes: dict[str, str]) -> dict:
    """Everything a stage's output depends on, as stored in its manifest (``inputs``) and hashed."""
    import torch
    import transformers

    payload = {
        "schema": SCHEMA_VERSION,
        "stage": stage.name,
        "config": hashed(stage.inputs(cfg)),
        "upstream": dict(upstream_hashes),
        "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
    }
    if stage.target_files:
        payload["target_fingerprint"] = target_fingerprint(cfg.target.name_or_path)
    return payload


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:20]


def inputs_hash(cfg: Config, stage: Stage, upstream: dict[str, dict]) -> str:
    """The hash of a stage's inputs given the upstream manifests."""
    return digest(stage_inputs(cfg, stage, {k: v["inputs_hash"] for k, v in upstream.items()}))


NEW = None  # the output id of a stage this command runs: not known until it completes


@dataclass
class _Plan:
    action: str  # use (not selected: its output is read) | skip | run (fresh) | resume (over its output) | start over
    inputs: dict
    inputs_hash: str
    why: str = ""  # for the log: what changed, or what more was asked
    upgraded: bool = False  # only an upgrade changed its inputs: its output is kept, its manifest rewritten


def run_stages(cfg: Config, world: World, stages: Sequence[Stage]) -> dict[str, dict]:
    """Run the selected stages of ``stages`` (pipeline/stages.py's PIPELINE) in order; return the manifest of
    every stage that is complete and current, each with ``action``: what this command did with it."""
    check_target_path(cfg.target.name_or_path)
    layout = RunLayout.of(cfg.run)
    by_name = {s.name: s for s in stages}
    # Rank 0 reads the manifests and decides for all, before any is written; its refusal reaches every rank.
    decided: dict[str, Any] = {}
    if world.is_main:
        old = {s.name: read_json(layout.manifest(s.name)) for s in stages}
        try:
            plans = plan_stages(cfg, stages, old, layout)
            for name, plan in plans.items():
                if plan.action not in ("use", "skip"):
                    by_name[name].check(by_name[name].inputs(cfg))
            decided = {"old": old, "plans": plans}
        except ValueError as e:
            decided = {"error": str(e)}
    decided = broadcast_object(decided)
    if "error" in decided:
        raise Refused(decided["error"])
    old, plans = decided["old"], decided["plans"]
    order = [s.name for s in stages]
    manifests: dict[str, dict] = {}  # the complete manifests later stages read
    result: dict[str, dict] = {}
    for name, plan in plans.items():
        if plan.action in ("use", "skip"):
            if plan.upgraded:
                log.warning("stage %s: %s", name, plan.why)
                old[name] = {**old[name], "inputs_hash": plan.inputs_hash, "inputs": plan.inputs}
                if world.is_main:
                    write_json_atomic(layout.manifest(name), old[name])
            elif plan.action == "skip":
                log.info("stage %s: up to date (manifest %s), skipped", name, plan.inputs_hash)
            manifests[name] = old[name]
            result[name] = {**old[name], "action": plan.action}
            continue
        stage_dir = layout.stage(name)
        read = {k: output_id(v) for k, v in manifests.items()}
        if world.is_main:
            if plan.action == "start over" and stage_dir.exists():
                log.warning("stage %s: %s; starting it over", name, plan.why)
                remove_owned(stage_dir, f"{name} stage", STAGE_FIX)  # planned already; a link: the link only
            elif plan.why:
                (log.warning if plan.upgraded else log.info)("stage %s: %s", name, plan.why)
            stage_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(layout.manifest(name), {
                "stage": name, "inputs_hash": plan.inputs_hash, "complete": False, "started": time.time(),
                "inputs": plan.inputs, "read": read})
        world.barrier()
        log.info("stage %s: running -> %s", name, stage_dir)
        t0 = time.time()
        job = StageContext(by_name[name].inputs(cfg), world, layout, name, dict(manifests))
        outputs = by_name[name].run(job) or {}
        outputs, new_id = broadcast_object((outputs, uuid.uuid4().hex))  # rank 0's summary and id are recorded
        world.barrier()
        complete = outputs.pop("complete", True) is not False
        manifest = {"stage": name, "inputs_hash": plan.inputs_hash, "complete": complete,
                    "seconds": round(time.time() - t0, 1), "outputs": outputs, "pid": os.getpid(),
                    "inputs": plan.inputs, "read": read}
        if complete:
            manifest["output_id"] = new_id
        else:
            manifest["partial"] = True
        if world.is_main:
            write_json_atomic(layout.manifest(name), manifest)
        world.barrier()
        if not complete:
            later = [s for s, p in plans.items() if order.index(s) > order.index(name) and p.action != "use"]
            log.warning("stage %s: partial output recorded, the stage stays incomplete%s", name,
                        f"; not running {later}" if later else "")
            break
        manifests[name] = manifest
        result[name] = {**manifest, "action": plan.action}
        log.info("stage %s: done in %.1fs", name, manifest["seconds"])
    return result


def output_id(manifest: dict) -> str:
    """The id of a complete stage's output ("" for manifests from before output ids)."""
    return manifest.get("output_id", "")


def plan_stages(cfg: Config, stages: Sequence[Stage], old: dict[str, dict | None],
                layout: RunLayout | None = None) -> dict[str, _Plan]:
    """Decide for every stage, before any runs, whether it is used as it is, skipped, run over its output or
    started over (the stages neither selected nor usable are left out); a change that would discard a
    costly output raises ValueError (one line) instead."""
    layout = layout or RunLayout.of(cfg.run)
    ahead: dict[str, tuple[str, str | None]] = {}  # stage -> (inputs hash, output id) later stages read
    plans: dict[str, _Plan] = {}
    upgraded: set[str] = set()  # stages whose inputs only an upgrade changed
    for stage in stages:
        name, m = stage.name, old[stage.name]
        if name not in cfg.run.stages:
            read = (m or {}).get("read") or {}
            if m and m.get("complete") and all(k in ahead and ahead[k][1] == v for k, v in read.items()):
                plans[name] = _Plan("use", m.get("inputs") or {}, m["inputs_hash"])
                ahead[name] = (m["inputs_hash"], output_id(m))
            continue
        up = stage.upstream
        if up and up not in ahead and stage.needs_upstream(stage.inputs(cfg)):
            raise ValueError(
                f"stage '{name}' needs the output of '{up}', which is missing, incomplete or out of date (a stage "
                f"before it ran again) in {layout.root}; add it to run.stages (e.g. run.stages=[{up},{name}])")
        inputs = stage_inputs(cfg, stage, {k: h for k, (h, _) in ahead.items()})
        h = digest(inputs)
        plan = _plan(cfg, stage, m, inputs, h, {k: out for k, (_, out) in ahead.items()}, [s.name for s in stages],
                     upgraded)
        plans[name] = plan
        if plan.upgraded:
            upgraded.add(name)
        if plan.action == "start over" or (plan.action == "run" and not _a_fledge_run(layout, name)):
            check_replaceable(layout.stage(name), f"{name} stage", STAGE_FIX)  # what it deletes or writes into
        ahead[name] = (plan.inputs_hash, output_id(m) if plan.action == "skip" else NEW)
    return plans


def _a_fledge_run(layout: RunLayout, name: str) -> bool:
    """Another stage of ``layout``'s run holds its manifest: the run directory is Fledge's, so a stage directory
    there without one (deleted, as a corrupt store slice's advice asks) is the run's own to run into."""
    others = [d for d in layout.root.iterdir() if d.is_dir() and d.name != name] if layout.root.is_dir() else []
    return any((read_json(layout.manifest(d.name)) or {}).get("stage") == d.name for d in others
               if layout.manifest(d.name).is_file())


def _plan(cfg: Config, stage: Stage, m: dict | None, inputs: dict, h: str, read: dict[str, str | None],
          order: list[str], upgraded: set[str] = frozenset()) -> _Plan:
    name = stage.name
    if name in cfg.run.force:
        return _Plan("start over", inputs, h, f"run.force=[{name}]")
    if not m:
        return _Plan("run", inputs, h)
    changes = describe_changes(m, inputs, h, read, cfg.run.force)
    if changes:
        if stage.rebuild:
            return _Plan("start over", inputs, h, f"inputs changed ({changes})")
        if _only_an_upgrade(m, inputs, read, upgraded):
            why = (f"recorded by another version of Fledge or its libraries ({changes}); nothing the run computes "
                   "changed, so its output is kept and its manifest now records this version")
            action = "skip" if m.get("complete") and stage.done(m, stage.inputs(cfg)) else "resume"
            return _Plan(action, inputs, h, why, upgraded=True)
        force = ",".join(s for s in order if s in cfg.run.force or s == name)
        raise ValueError(f"{name}: its inputs changed since it ran ({changes}); its output is kept: "
                         f"run.force=[{force}] starts {name} over on them (deleting that output), or a new "
                         "run.name starts a separate run")
    if not m.get("complete"):
        return _Plan("resume", inputs, h, "incomplete: running it again over its own output")
    if stage.done(m, stage.inputs(cfg)):
        return _Plan("skip", inputs, h)
    return _Plan("resume", inputs, h, "complete, and this config asks for more: running it again over its output")


def describe_changes(m: dict, inputs: dict, h: str, read: dict[str, str | None], force: list[str]) -> str:
    """What differs between a stage's manifest and its inputs now, as 'what: old -> new; ...' ("" if nothing):
    upstream outputs made by this command or replaced since, then changed config keys, versions, target."""
    out, replaced = [], set()
    for stage, now in read.items():
        if now is NEW:
            out.append(f"{stage}'s output: {'starts over' if stage in force else 'runs again'} in this command")
        elif "read" in m and m["read"].get(stage) != now:
            out.append(f"{stage}'s output: replaced since this stage ran")
        else:
            continue
        replaced.add(f"upstream.{stage}")
    if m.get("inputs_hash") != h and "inputs" not in m:
        out.append(f"its manifest keeps only a hash of them ({m.get('inputs_hash')} -> {h})")
    elif m.get("inputs_hash") != h:
        was, now_ = dict(_flatten(m["inputs"])), dict(_flatten(json.loads(json.dumps(inputs, default=str))))
        out += [f"{_key_name(k)}: {_short(was.get(k, '(absent)'))} -> {_short(now_.get(k, '(absent)'))}"
                for k in sorted(was.keys() | now_.keys()) if was.get(k) != now_.get(k) and k not in replaced]
    return "; ".join(out)


def _only_an_upgrade(m: dict, inputs: dict, read: dict[str, str | None], upgraded: set[str]) -> bool:
    """Whether every difference between the manifest ``m`` and ``inputs`` is one an upgrade of Fledge or its
    libraries makes, not the user: library versions and the payload's schema, a config key this version no
    longer hashes (whatever its value), a key the older Fledge did not read that stands at the schema's default,
    and the hash of an upstream stage whose own difference was such. The outputs it read must be the ones there now."""
    if "inputs" not in m or any(now is NEW or ("read" in m and m["read"].get(s) != now) for s, now in read.items()):
        return False
    was, now = dict(_flatten(m["inputs"])), dict(_flatten(json.loads(json.dumps(inputs, default=str))))
    for k in was.keys() | now.keys():
        if was.get(k, _ABSENT) == now.get(k, _ABSENT) or k.startswith("versions.") or k == "schema":
            continue
        if k.startswith("upstream.") and k[len("upstream."):] in upgraded:
            continue
        if k.startswith("config.") and k not in now:
            continue  # this version no longer hashes the key (it says the output does not depend on it)
        if k.startswith("config.") and k not in was and now[k] == _schema_default(k[len("config."):]):
            continue  # a key the older version did not read, at the default it behaved as
        return False
    return True


_ABSENT = object()


def _schema_default(key: str) -> Any:
    """The schema's default of the config key ``key`` (dotted) as a manifest records it, or _ABSENT."""
    obj: Any = Config
    for part in key.split("."):
        field = {f.name: f for f in dataclasses.fields(obj)}.get(part) if dataclasses.is_dataclass(obj) else None
        if field is None:
            return _ABSENT
        if field.default is not dataclasses.MISSING:
            obj = field.default
        elif field.default_factory is not dataclasses.MISSING:
            obj = field.default_factory()
        else:
            return _ABSENT
    if dataclasses.is_dataclass(obj):
        return _ABSENT  # a whole section is recorded key by key
    return json.loads(json.dumps(obj, default=str))


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
        return "drafter.aux_layer_ids" if key == "aux_layer_ids" else key
    if key == "target_fingerprint":
        return "the target's files (target.name_or_path)"
    if key.startswith("upstream."):
        return f"{key[len('upstream.'):]}'s inputs"
    return key  # versions.torch, versions.transformers, schema


def _short(v: Any, width: int = 60) -> str:
    s = json.dumps(v, sort_keys=True, default=str) if not isinstance(v, str) else v
    return s if len(s) <= width else s[: width - 3] + "..."
