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

    target = FrozenTarget.load(cfg.target, w.device, cfg.aux_layer_ids(), cfg.capture.device_map)
    return tuple(OnlineFeatureSource(ctx.layout.prepare.split(split), target, rank, world_size,
                                     t.micro_batch_tokens, t.micro_batch_size, cfg.run.seed,
                                     chunk_tokens=cfg.capture.chunk_tokens)
                 for split in ("train", "eval"))
