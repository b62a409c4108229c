"""What a pipeline stage receives (the runner, fledge/pipeline/runner.py, builds one per stage): its job.

Its own module below the pipeline because the stages' work lives in the layers under it: the train stage's
trainer (train/trainer.py) takes one, and it must not import the pipeline that calls it.

A stage sees the run config only through a :class:`ConfigSlice`: the keys its record declares
(:class:`Reads`, pipeline/stages.py), each either hashed (a change to it changes the stage's output) or
runtime (it lays out or paces the work: cadence, parallelism, an engine's patience). The runner hashes the
slice's hashed keys, so what is hashed is what the stage reads; a read of any other key fails at once,
naming the key and the record to declare it in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fledge.conf.schema import Config
from fledge.distributed import World
from fledge.run_layout import RunLayout


@dataclass(frozen=True)
class Reads:
    """The config keys a stage reads, dotted (``target``, ``train.max_steps``, or ``aux_layer_ids``: a
    :class:`Config` method, read as its value). ``hashed``: its output depends on them, a sub-key also named
    in ``runtime`` excepted. ``runtime``: read, never hashed."""

    hashed: tuple[str, ...]
    runtime: tuple[str, ...] = ()


class UndeclaredRead(RuntimeError):
    """A stage read a config key its record does not declare (a programming error, not a user's)."""


def _value(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj() if callable(obj) else obj


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))


def _without(value: Any, subkeys: Iterable[list[str]]) -> Any:
    """``value`` (plain) with the dotted ``subkeys`` (each split, relative to it) left out."""
    for path in subkeys:
        node = value
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return value


class _View:
    """One level of the config a stage reads only part of: its declared keys pass through, others raise."""

    def __init__(self, obj: Any, prefix: str, declared: frozenset[str], stage: str):
        self._obj, self._prefix, self._declared, self._stage = obj, prefix, declared, stage

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probing for protocols
            raise AttributeError(name)
        key = f"{self._prefix}{name}"
        if key in self._declared or any(key.startswith(f"{d}.") for d in self._declared):
            return getattr(self._obj, name)  # declared whole (or under a declared key): the real value
        if any(d.startswith(f"{key}.") for d in self._declared):
            return _View(getattr(self._obj, name), f"{key}.", self._declared, self._stage)
        raise UndeclaredRead(f"stage {self._stage} read cfg.{key}, which its record does not declare: add it to "
                             f"the stage's Reads in pipeline/stages.py (hashed, or runtime if it only paces the work)")

    def __repr__(self) -> str:
        return f"<config slice {self._prefix or 'cfg.'} of stage {self._stage}>"


class ConfigSlice(_View):
    """The run config as one stage may read it (:class:`Reads`); :meth:`hashed` is what the runner hashes."""

    def __init__(self, cfg: Config, reads: Reads, stage: str):
        super().__init__(cfg, "", frozenset(reads.hashed) | frozenset(reads.runtime), stage)
        self._reads = reads

    def hashed(self) -> dict[str, Any]:
        """{key: its value, plain and without its runtime sub-keys} for every hashed key."""
        runtime = self._reads.runtime
        return {key: _without(_plain(_value(self._obj, key)),
                              [r[len(key) + 1:].split(".") for r in runtime if r.startswith(f"{key}.")])
                for key in self._reads.hashed}


@dataclass
class StageContext:
    """What a stage receives: its slice of the config, the world, the run's layout and the upstream
    manifests. ``cfg`` is a :class:`ConfigSlice` when the runner builds it (a test may pass a whole
    :class:`Config`)."""

    cfg: Config | ConfigSlice
    world: World
    layout: RunLayout
    stage: str  # this stage's name
    upstream: dict[str, dict]  # stage name -> its complete manifest (all earlier stages present)

    @property
    def stage_dir(self) -> Path:
        """This stage's directory (``layout.stage(stage)``)."""
        return self.layout.stage(self.stage)
