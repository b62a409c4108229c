"""The trainer's data: the feature store (offline) or the live target (online), as global-plan loaders.

Both are ``data.feature_reader.BatchIterator`` subclasses: a batch plan that does not depend on the
world size, rank r taking global batches r, r+W, ..., and one integer of state (global batches
consumed), so a kill, a resume or a change of world size continues exactly where training stopped.
"""

from __future__ import annotations

import torch

from fledge.conf.schema import Config
from fledge.data.capture.offline import OnlineFeatureSource
from fledge.data.features.reader import BatchIterator, FeatureLoader
from fledge.models.target import FrozenTarget
from fledge.train.runner import StageContext


def _engine_sources(cfg: Config, ctx: StageContext, dtype: torch.dtype, rank: int, world_size: int):
    """capture.mode=online, capture.engine=vllm: an engine per rank (or per capture.ranks_per_engine ranks)
    streams each split (data/capture/stream.py)."""
    from fledge.data.capture.engine import engine_setup
    from fledge.data.capture.stream import EngineFeatureSource, StreamSpec

    t, cap, w, tc = cfg.train, cfg.capture, ctx.world, cfg.target
    eng = engine_setup(tc, cap, cfg.aux_layer_ids(), w)
    if cap.ranks_per_engine > 1 and world_size != w.world_size:
        raise ValueError(f"capture.ranks_per_engine={cap.ranks_per_engine} with train.sequence_parallel="
                         f"{t.sequence_parallel}: a shared engine serves data-parallel ranks; set one to 1")
    spec = dict(python=eng.python, target=tc.name_or_path, revision=tc.revision,
                trust_remote_code=tc.trust_remote_code, dtype=eng.dtype, feature_dtype=dtype,
                aux_layer_ids=list(cfg.aux_layer_ids()), num_layers=eng.shape.num_hidden_layers,
                rms_norm_eps=eng.shape.rms_norm_eps, aux_dtype=cap.dtype, env=eng.env, timeout_s=cap.engine_timeout_s,
                buffer_batches=cap.buffer_batches, restarts=cap.engine_restarts, device=w.device,
                launcher=tuple(cap.engine_launcher), ranks_per_engine=cap.ranks_per_engine, grad_accum=t.grad_accum)
    # the train source's end (where the engine's job stops) is the trainer's: seek(position, end) at its resume
    out = []
    for split in ("train", "eval"):  # the held-out set's engines take the training engine's place (its GPUs)
        out.append(EngineFeatureSource(ctx.layout.prepare.split(split),
                                       StreamSpec(workdir=ctx.layout.train.stream / f"rank{w.rank:05d}", **spec),
                                       rank, world_size, t.micro_batch_tokens, t.micro_batch_size, cfg.run.seed,
                                       name=split, displaces=out[0] if out else None))
    w.barrier()  # every rank's spool is cleared before any leader's engine writes into it
    return tuple(out)


def build_loaders(cfg: Config, ctx: StageContext, dtype: torch.dtype, rank: int | None = None,
                  world_size: int | None = None) -> tuple[BatchIterator, BatchIterator]:
    """This rank's (train, eval) loaders; online mode shares one frozen target between them. ``rank`` /
    ``world_size``: the data-parallel ones when they differ from the world's (sequence parallelism: every
    rank of a group reads the group's batches)."""
    t, w = cfg.train, ctx.world
    rank = w.rank if rank is None else rank
    world_size = w.world_size if world_size is None else world_size
    if cfg.capture.mode == "offline":

        loaders = tuple(FeatureLoader(ctx.layout.capture.store(split), rank, world_size, t.micro_batch_tokens,
                                      t.micro_batch_size, cfg.run.seed, dtype=dtype,
                                      stage_manifest=ctx.layout.manifest("capture")) for split in ("train", "eval"))
        for loader in loaders:
            loader.store.check_compatible(cfg.target, cfg.aux_layer_ids())
        return loaders

    if cfg.capture.engine == "vllm":
        return _engine_sources(cfg, ctx, dtype, rank, world_size)
    target = FrozenTarget.load(cfg.target, w.device, cfg.aux_layer_ids(), cfg.capture.device_map)
    return tuple(OnlineFeatureSource(ctx.layout.prepare.split(split), target, rank, world_size,
                                     t.micro_batch_tokens, t.micro_batch_size, cfg.run.seed,
                                     chunk_tokens=cfg.capture.chunk_tokens)
                 for split in ("train", "eval"))
