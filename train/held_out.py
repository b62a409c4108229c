"""The trainer's held-out evaluation: teacher-forced metrics over the held-out split's first global batches.

Every rank reads as many held-out batches (padded with uncounted fillers), so all of them reach the end together,
and the metrics are reduced exactly over ranks (train/metrics.py): the figures are the same on any world size.
SIGTERM cuts an evaluation short at the next batch, on every rank alike (``StreamInterrupted``), so a long held-out
set never outlasts a job's grace period (train/trainer.py then checkpoints and exits).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from fledge import signals
from fledge.data.features.source import FeatureSource, StreamInterrupted
from fledge.distributed import World, any_rank
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.train.metrics import RatioMeter


@torch.no_grad()
def held_out_metrics(engine, data: FeatureSource, n_batches: int, draft_steps: int, world: World, dtype: torch.dtype,
                     seq=None) -> dict[str, float]:
    """Teacher-forced held-out metrics (``eval/`` names, with ``eval/al_estimate`` over ``draft_steps``) over
    ``n_batches`` (``train.eval_batches``) global batches, split over the data-parallel ranks (``data.eval_batches``),
    so the same on any world size (``seq``: the rank's ``SequenceParallel``, which splits each batch over its group).
    ``engine``: the DeepSpeed engine, or the bare module, whose forward gives the batch's metrics."""
    meter = RatioMeter()
    engine.eval()
    try:
        for batch, counts in _agreed(data.eval_batches(n_batches)):
            metrics = engine((seq.split(batch) if seq else batch).to(world.device, dtype)).metrics
            if not counts:  # a filler forward: zeros under the same names, which reduce() all-reduces on every rank
                metrics = {k: (torch.zeros_like(num), torch.zeros_like(torch.as_tensor(den))) for k, (num, den) in
                           metrics.items()}
            meter.add(metrics)
    finally:
        engine.train()
    values = {f"eval/{k}": v for k, v in meter.reduce().items()}
    values["eval/al_estimate"] = al_estimate(StepAccuracy.from_values(values, draft_steps, prefix="eval/"))
    return values


def _agreed(batches: Iterable) -> Iterator:
    """``batches``, each once every rank has its own (their forwards may be collectives: ZeRO-3 gathers); a
    StreamInterrupted on every rank as soon as any rank was told to stop (SIGTERM: a stream's read cut short, or a
    flag between batches of a store's, so a long held-out set never outlasts the grace period)."""
    it = iter(batches)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except StreamInterrupted:
            item = None
        if any_rank(item is None or signals.stopping()):
            raise StreamInterrupted("SIGTERM during the held-out evaluation")
        yield item
