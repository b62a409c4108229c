"""``capture.mode=online`` with ``capture.engine=hf``: the target beside the drafter, run on the training rank.

``OnlineFeatureSource`` computes each batch's states with the in-process target as the capture stage would
(data/capture/offline.py ``capture_rows``: one padded forward per batch) and yields the same FeatureBatch as the
offline FeatureLoader; nothing is written. Chosen by data/capture/sources.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fledge.data.capture.offline import capture_rows, dataset_lengths
from fledge.data.features.reader import BatchIterator
from fledge.models.target import FrozenTarget


class OnlineFeatureSource(BatchIterator):
    """``capture.mode=online``: the same batches as FeatureLoader, computed by the target each step.

    Samples come from the prepared split in ``dataset_dir`` (``<run>/prepare/<split>``); ``target`` runs on
    this rank's device, and the sample dicts (aux in the target's dtype, no fp8) stay on that device for
    collate. ``rank``, ``world``, ``row_tokens``, ``rows_per_batch`` and ``seed`` as for FeatureLoader."""

    def __init__(self, dataset_dir: str | Path, target: FrozenTarget, rank: int, world: int, row_tokens: int,
                 rows_per_batch: int, seed: int, chunk_tokens: int = 0):
        from datasets import load_from_disk

        self.ds = load_from_disk(str(dataset_dir))
        self.target, self.chunk_tokens = target, chunk_tokens
        super().__init__(dataset_lengths(self.ds), rank, world, row_tokens, rows_per_batch, seed)

    def fetch(self, indices: list[int]) -> list[dict]:
        rows = self.ds.select(indices)
        out = []  # one target forward (padded) for all samples of the batch
        for row, (aux, final, argmax) in zip(rows, capture_rows(self.target, [x["input_ids"] for x in rows],
                                                                      self.chunk_tokens)):
            dev = aux.device
            out.append({"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long, device=dev),
                        "loss_mask": torch.as_tensor(row["loss_mask"], device=dev).bool(),
                        "aux_hidden": aux, "target_hidden": final, "target_argmax": argmax})
        return out
