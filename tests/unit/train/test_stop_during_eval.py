"""SIGTERM during the trainer's held-out evaluation on an offline store (train/held_out.py): only a
streamed read (capture.mode=online) could cut an evaluation short, so on a store every one of
``train.eval_batches`` held-out batches was evaluated before the step boundary saw the signal: a long held-out set
outlasted Slurm's grace period and the job was killed without its checkpoint. The evaluation now stops at the
next batch, on every rank alike (the run then checkpoints and exits 75)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from fledge import signals
from fledge.data.features.source import StreamInterrupted
from fledge.distributed import World
from fledge.train.held_out import held_out_metrics


class _Batch:
    def to(self, device, dtype):
        return self


class _Store:
    """An offline store's held-out batches (feature_sources' reader): each read at once, none interruptible."""

    def __init__(self):
        self.read = 0

    def eval_batches(self, n: int):
        for _ in range(n):
            self.read += 1
            yield _Batch(), 1


class _Engine:
    """The DeepSpeed engine's forward; the job's SIGTERM arrives during the first one."""

    def __init__(self):
        self.forwards = 0

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, batch):
        self.forwards += 1
        if self.forwards == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        one = torch.tensor(1.0)
        return SimpleNamespace(metrics={"acc_0": (one, one), "loss_0": (one, one)})


def test_sigterm_during_a_held_out_eval_on_the_store_stops_it_at_the_next_batch():
    store, engine = _Store(), _Engine()
    with signals.held():  # as run_training holds the stop signals
        with pytest.raises(StreamInterrupted):
            held_out_metrics(engine, store, 40, 1, World(0, 1, 0, torch.device("cpu")), torch.float32)
        assert signals.stopping()
    assert engine.forwards == 1 and store.read <= 2, (engine.forwards, store.read)
