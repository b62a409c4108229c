"""Where training gets its features: the one choice between the capture stage's store, the live target and a vLLM
stream, made here for the trainer.

- ``store`` (``capture.mode=offline``, whichever engine made the store): ``FeatureLoader`` over
  ``<run>/capture/<split>`` (data/features/reader.py), checked against the run's target and aux ids.
- ``hf`` (``capture.mode=online capture.engine=hf``): ``OnlineFeatureSource``, one ``FrozenTarget`` on this rank
  shared by both splits (data/capture/online.py).
- ``vllm-stream`` (``capture.mode=online capture.engine=vllm``): ``EngineFeatureSource``, an engine per rank or per
  ``capture.ranks_per_engine`` ranks (data/capture/stream.py), set up as offline capture sets up its own
  (data/capture/engine.py ``engine_setup``).

Every one is a ``BatchIterator`` (data/features/reader.py): a batch plan that does not depend on the world size,
rank r taking global batches r, r+W, ..., and one integer of state (global batches consumed), so a kill, a resume or
a change of world size continues exactly where training stopped, whichever source feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fledge.conf.schema import CaptureConfig, TargetConfig, TrainConfig
from fledge.data.capture.engine import engine_setup
from fledge.data.capture.online import OnlineFeatureSource
from fledge.data.capture.stream import EngineFeatureSource, StreamSpec
from fledge.data.features.reader import BatchIterator, FeatureLoader
from fledge.distributed import World
from fledge.models.target import FrozenTarget
from fledge.run_layout import RunLayout

SPLITS = ("train", "eval")  # what the trainer reads: the training split and the held-out one
SOURCES = ("store", "hf", "vllm-stream")


def source_kind(mode: str, engine: str) -> str:
    """The feature source ``capture.mode`` and ``capture.engine`` name (one of SOURCES); ValueError, one line naming
    both keys and what they may be, for any other pair."""
    if mode == "offline":  # the engine made the store; the trainer reads it the same way
        return "store"
    if mode == "online" and engine in ("hf", "vllm"):
        return "hf" if engine == "hf" else "vllm-stream"
    raise ValueError(f"capture.mode={mode!r} capture.engine={engine!r}: no feature source for training; expected "
                     "capture.mode=offline (the capture stage's store), or capture.mode=online with capture.engine=hf "
                     "(the target on each rank) or vllm (a served target's stream)")


def feature_sources(target: TargetConfig, capture: CaptureConfig, train: TrainConfig, aux_layer_ids: Sequence[int],
                    seed: int, layout: RunLayout, world: World, dtype: torch.dtype, rank: int | None = None,
                    world_size: int | None = None) -> tuple[BatchIterator, BatchIterator]:
    """This rank's (train, eval) feature sources for a run in ``layout`` of ``target`` with these ``capture`` and
    ``train`` settings, its drafter reading ``aux_layer_ids``, its batch order drawn from ``seed``: float features
    in ``dtype``. ``rank`` / ``world_size``: the data-parallel ones when they differ from ``world``'s (sequence
    parallelism: every rank of a group reads the group's batches)."""
    kind = source_kind(capture.mode, capture.engine)
    rank = world.rank if rank is None else rank
    world_size = world.world_size if world_size is None else world_size
    plan = (rank, world_size, train.micro_batch_tokens, train.micro_batch_size, seed)
    if kind == "store":
        loaders = tuple(FeatureLoader(layout.capture.store(split), *plan, dtype=dtype,
                                      stage_manifest=layout.manifest("capture")) for split in SPLITS)
        for loader in loaders:
            loader.store.check_compatible(target, aux_layer_ids)
        return loaders
    if kind == "vllm-stream":
        if capture.ranks_per_engine > 1 and world_size != world.world_size:
            raise ValueError(f"capture.ranks_per_engine={capture.ranks_per_engine} with train.sequence_parallel="
                             f"{train.sequence_parallel}: a shared engine serves data-parallel ranks; set one to 1")
        return _stream_sources(target, capture, train.grad_accum, aux_layer_ids, layout, world, dtype, plan)
    frozen = FrozenTarget.load(target, world.device, aux_layer_ids, capture.device_map)
    return tuple(OnlineFeatureSource(layout.prepare.split(split), frozen, *plan, chunk_tokens=capture.chunk_tokens)
                 for split in SPLITS)


def _stream_sources(tc: TargetConfig, cap: CaptureConfig, grad_accum: int, aux_layer_ids: Sequence[int],
                    layout: RunLayout, world: World, dtype: torch.dtype,
                    plan: tuple) -> tuple[EngineFeatureSource, EngineFeatureSource]:
    """``vllm-stream``: each split streamed by this rank's engine (or its group's), under
    ``<run>/train/stream/rankNNNNN``. ``plan``: (data-parallel rank, its world size, row tokens, rows per batch,
    seed). The train source's end (where its engine's job stops) is the trainer's, set with ``seek(position, end)``
    at its resume; the held-out set's engines take the training engine's place (its GPUs)."""
    eng = engine_setup(tc, cap, aux_layer_ids, world)
    spec = dict(python=eng.python, target=tc.name_or_path, revision=tc.revision,
                trust_remote_code=tc.trust_remote_code, dtype=eng.dtype, feature_dtype=dtype,
                aux_layer_ids=list(aux_layer_ids), num_layers=eng.shape.num_hidden_layers,
                rms_norm_eps=eng.shape.rms_norm_eps, aux_dtype=cap.dtype, env=eng.env, timeout_s=cap.engine_timeout_s,
                buffer_batches=cap.buffer_batches, restarts=cap.engine_restarts, device=world.device,
                launcher=tuple(cap.engine_launcher), ranks_per_engine=cap.ranks_per_engine, grad_accum=grad_accum,
                tensor_parallel_size=cap.tensor_parallel_size, expert_parallel=cap.expert_parallel)
    out: list[EngineFeatureSource] = []
    for split in SPLITS:
        out.append(EngineFeatureSource(layout.prepare.split(split),
                                       StreamSpec(workdir=layout.train.stream / f"rank{world.rank:05d}", **spec),
                                       *plan, name=split, displaces=out[0] if out else None))
    world.barrier()  # every rank's spool is cleared before any leader's engine writes into it
    return tuple(out)
