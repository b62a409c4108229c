"""What the trainer asks of a feature source: the ``FeatureSource`` protocol, and the exception that ends a wait.

Every source the trainer reads (data/capture/sources.py picks one) serves the same global batch plan
(data/features/reader.py ``BatchIterator``): the offline store's ``FeatureLoader``, the in-process target's
``OnlineFeatureSource`` (data/capture/online.py) and a vLLM engine's stream, ``EngineFeatureSource``
(data/capture/stream.py). A source that makes its batches elsewhere, and may have the trainer wait for them, says so
through three methods whose defaults here fit a source that reads at once (a store): ``stop_when`` (a wait that must
end on SIGTERM), ``stats`` (what the train stage's manifest records of it) and ``close`` (what it started ends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from fledge.data.features.batch import FeatureBatch


class StreamInterrupted(Exception):
    """SIGTERM arrived while this rank waited for a batch (the flag of ``FeatureSource.stop_when``): the wait was
    given up, and nothing was started to make the batch."""


class FeatureSource(Protocol):
    """This rank's batches of the global plan, from ``position`` (global batches consumed by all ranks together).

    ``next_batch`` gives this rank's next batch and its global index; ``eval_batches(n)`` this rank's share of the
    held-out set as (batch, counts) pairs, the same number on every rank; ``seek(position, end)`` continues at
    ``position``, ``end`` the global batch the run stops before."""

    position: int

    @property
    def global_batches_per_epoch(self) -> int: ...

    def seek(self, position: int, end: int | None = None) -> None: ...

    def next_batch(self) -> tuple[int, FeatureBatch]: ...

    def eval_batches(self, n: int) -> Iterator[tuple[FeatureBatch, bool]]: ...

    def stop_when(self, stopping: Callable[[], bool]) -> None:
        """Give up a wait for a batch (``StreamInterrupted``) once ``stopping()`` is true. A source that never
        waits ignores it: the trainer checks the flag itself between batches."""

    def stats(self) -> dict[str, float | int]:
        """What the train stage's outputs record of how this source ran (an engine's waits and starts)."""
        return {}

    def close(self) -> None:
        """End what the source started (an engine); a source that started nothing has nothing to end."""
