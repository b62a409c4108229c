"""What each pipeline stage's library receives: one frozen dataclass per stage, holding exactly what it reads.

pipeline/stages.py builds them from the run config; the libraries below the pipeline (data/, train/, evaluation/,
serving/) take these, never the whole config. The runner hashes them with :func:`hashed`: each field says how in
its metadata, so what is hashed is what the library is given. A field is

- ``hashed_as("run.seed")``: hashed under the config key it comes from (a section less its ``runtime`` fields:
  names, or a function of the section's value when which fields pace the work depends on the section);
- ``hashed_each("target", names)``: the section's ``names`` hashed as keys of their own (``target.revision``);
- ``runtime()``: read, never hashed: it lays out or paces the work (a run in flight may change it).

The dotted keys are the ones the manifests of every earlier Fledge recorded, so a run directory keeps resuming
(tests/unit/pipeline/test_recorded_inputs.py holds the hashes to the recorded ones).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fledge.conf.schema import (
    CaptureConfig,
    DataConfig,
    DeepSpeedConfig,
    DrafterConfig,
    EvalConfig,
    ExportConfig,
    LoggingConfig,
    TargetConfig,
    TrainConfig,
)

_KEY, _EACH, _RUNTIME = "key", "each", "runtime"


def hashed_as(key: str, runtime: Iterable[str] | Callable[[Any], Iterable[str]] = ()) -> Any:
    """A field hashed as the config key ``key``, without its ``runtime`` fields (names of the section's fields)."""
    return field(metadata={_KEY: key, _RUNTIME: runtime if callable(runtime) else tuple(runtime)})


def hashed_each(section: str, names: Iterable[str]) -> Any:
    """A section of which only ``names`` are hashed, each as its own key ``<section>.<name>``."""
    return field(metadata={_KEY: section, _EACH: tuple(names)})


def runtime() -> Any:
    """A field read, never hashed."""
    return field(metadata={_RUNTIME: True})


# The run's length, cadence and layout over ranks: the runner's Stage.done and the trainer handle them, so a run
# resumes under others. The layout (tests/distributed/test_train.py checks each on a resumed run): the rows split
# over a sequence-parallel group, and the optimizer step made of grad_accum micro-batches on each data-parallel
# rank; a step of another size is the trainer's warning (train/trainer.py), not a new run, so a requeued job on
# fewer nodes goes on.
TRAIN_RUNTIME = ("max_steps", "epochs", "save_every", "keep_last", "eval_every", "eval_batches", "log_every",
                 "max_nonfinite", "sequence_parallel", "grad_accum")
PUBLISH_KEYS = ("push_to_hub", "repo_id", "private")  # the publish stage's export keys; the export stage's are the rest
# The target as the stages that load it read it (from its files): its inline config is export's (and the card's).
TARGET_LOADED = tuple(f.name for f in dataclasses.fields(TargetConfig) if f.name != "config_overrides")
# capture.mode=online: the capture keys that change the states the trainer gets (with the target and the aux ids);
# the rest (buffer, restarts, parallelism, batch sizes) is how the engine runs, so a run in flight may change it.
ONLINE_STATE_KEYS = ("mode", "engine", "dtype")
ENGINE_KEYS = ("engine", "tensor_parallel_size", "expert_parallel", "data_parallel_size")  # vLLM's, unread by hf
# The engine's python, patience and placement, and which slice of an array capture this task writes: how the
# capture runs, not what it stores (the array's tasks and its merge share one hash).
CAPTURE_RUNTIME = ("engine_python", "engine_timeout_s", "engine_launcher", "ranks_per_engine", "num_slices",
                   "slice_index")
# Config keys added since the manifests of earlier Fledges were recorded (tests/fixtures/stage_inputs/), under a
# hashed_as section: each stays out of the hash while it stands at its default, the behaviour those runs had, so
# their run directories keep their hashes; set to anything else, it is hashed like any key.
ADDED_KEYS = ("train.optim.name", "train.optim.muon_lr", "train.optim.muon_momentum", "train.optim.muon_weight_decay",
              "drafter.markov_rank")


def capture_runtime(capture: CaptureConfig) -> tuple[str, ...]:
    """The capture fields that do not change the states captured: online only ONLINE_STATE_KEYS do; offline with
    engine=hf the vLLM keys are not read."""
    if capture.mode == "online":
        return tuple(f.name for f in dataclasses.fields(capture) if f.name not in ONLINE_STATE_KEYS)
    return CAPTURE_RUNTIME + (ENGINE_KEYS if capture.engine == "hf" else ())


@dataclass(frozen=True)
class PrepareInputs:
    """The data section, the target's tokenizer, the vocab size and the seed; data.num_proc only sets how many
    processes tokenize (map keeps the row order: the same output on any count)."""

    data: DataConfig = hashed_as("data", runtime=("num_proc",))
    target: TargetConfig = hashed_each("target", TARGET_LOADED)
    draft_vocab_size: int = hashed_as("drafter.draft_vocab_size")
    seed: int = hashed_as("run.seed")


@dataclass(frozen=True)
class CaptureInputs:
    """The target, the capture section (less what only runs the engine: :func:`capture_runtime`), the aux ids."""

    target: TargetConfig = hashed_each("target", TARGET_LOADED)
    capture: CaptureConfig = hashed_as("capture", runtime=capture_runtime)
    aux_layer_ids: tuple[int, ...] = hashed_as("aux_layer_ids")


@dataclass(frozen=True)
class TrainInputs:
    """The drafter, the optimizer and what the states are (the target, and how capture reads it: online, the
    states come from here); the run's length, cadence and layout are runtime, as are the rest of the capture
    keys (offline they find capture's store, whose own hash covers what it holds; online they run the engine)
    and where the metrics go."""

    drafter: DrafterConfig = hashed_as("drafter")
    train: TrainConfig = hashed_as("train", runtime=TRAIN_RUNTIME)
    deepspeed: DeepSpeedConfig = hashed_as("deepspeed")
    target: TargetConfig = hashed_each("target", TARGET_LOADED)
    aux_layer_ids: tuple[int, ...] = hashed_as("aux_layer_ids")
    seed: int = hashed_as("run.seed")
    capture: CaptureConfig = hashed_each("capture", ONLINE_STATE_KEYS)
    logging: LoggingConfig = runtime()
    run_name: str = runtime()
    recipe: str = runtime()


@dataclass(frozen=True)
class ExportInputs:
    """Besides the checkpoint: the target's config (its local config.json, which the fingerprint covers, else
    target.config_overrides, else the hub's), its name and the draft length (the speculators dialect writes both)."""

    export: ExportConfig = hashed_as("export", runtime=PUBLISH_KEYS)
    target: TargetConfig = hashed_as("target")
    draft_tokens: int = hashed_as("eval.draft_tokens")


@dataclass(frozen=True)
class EvalInputs:
    """The eval section, and what the measurement runs on besides the export: the target, its chat template,
    the draft depth trained, the seed and the capture's chunking of long prompts."""

    eval: EvalConfig = hashed_as("eval")
    target: TargetConfig = hashed_as("target")
    chat_template: str | None = hashed_as("data.chat_template")
    ttt_steps: int = hashed_as("drafter.ttt_steps")
    algorithm: str = hashed_as("drafter.algorithm")
    block_size: int = hashed_as("drafter.block_size")
    seed: int = hashed_as("run.seed")
    chunk_tokens: int = hashed_as("capture.chunk_tokens")


@dataclass(frozen=True)
class PublishInputs:
    """Where to push, and what the card says besides the run's measurements (the target's config and the draft
    length, as export wrote them); ``stages``: whether this run publishes at all."""

    export: ExportConfig = hashed_each("export", PUBLISH_KEYS)
    target: TargetConfig = hashed_as("target")
    draft_tokens: int = hashed_as("eval.draft_tokens")
    stages: tuple[str, ...] = runtime()


StageInputs = PrepareInputs | CaptureInputs | TrainInputs | ExportInputs | EvalInputs | PublishInputs


def hashed(inputs: StageInputs) -> dict[str, Any]:
    """{config key: its value, plain (JSON types), without its runtime fields} for every hashed field of
    ``inputs``: what the runner hashes and the stage's manifest records."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(inputs):
        meta, value = f.metadata, getattr(inputs, f.name)
        if _KEY not in meta:
            continue
        if _EACH in meta:
            out.update({f"{meta[_KEY]}.{name}": _plain(getattr(value, name)) for name in meta[_EACH]})
            continue
        skip = meta[_RUNTIME](value) if callable(meta[_RUNTIME]) else meta[_RUNTIME]
        plain = _without_added_defaults(meta[_KEY], value, _plain(value))
        out[meta[_KEY]] = {k: v for k, v in plain.items() if k not in skip} if skip else plain
    return out


def _without_added_defaults(key: str, value: Any, plain: Any) -> Any:
    """``plain`` (section ``key``'s value) less the ADDED_KEYS under it that stand at their defaults."""
    paths = [k[len(key) + 1:].split(".") for k in ADDED_KEYS if k.startswith(key + ".")]
    default = _plain(type(value)()) if paths else None
    for *parents, name in paths:
        node, ref = plain, default
        for part in parents:
            node, ref = node[part], ref[part]
        if name in node and node[name] == ref[name]:
            del node[name]
    return plain


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))
