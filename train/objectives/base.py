"""What an algorithm's training module registers (train/objectives/): a builder of the :class:`Trainable` it trains,
the drafter, the teacher's head it is scored against and its :class:`Objective` over the shared feature batch, which
train/ttt_model.py wraps into the module DeepSpeed trains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fledge.data.features.batch import FeatureBatch
from fledge.registry import Registry
from fledge.stage_inputs import TrainInputs
from fledge.train.losses import TTTLoss, TTTResult


class Objective(Protocol):
    """The training loss of one algorithm's drafter: what the trainer calls on each micro-batch, and the rows it
    counts there (per step or block offset, summed over an optimizer step: train/losses/base.py
    ``step_denominators``). ``shard`` is one rank's part of a row under sequence parallelism, else None."""

    def __call__(self, drafter: nn.Module, batch: FeatureBatch, teacher_head: torch.Tensor, shard: Any = None,
                 denominators: torch.Tensor | None = None) -> TTTResult: ...

    def counted_rows(self, drafter: nn.Module, batch: FeatureBatch, shard: Any = None) -> torch.Tensor: ...


@dataclass
class Trainable:
    """One algorithm's drafter for training (on the CPU, initialised), the frozen teacher head its objective scores
    against (rows of the target's lm_head) and the objective."""

    drafter: nn.Module
    teacher_head: torch.Tensor
    objective: Objective


# (the train stage's inputs, the target's config, the registered loss drafter.loss selects, the prepare stage's draft
# vocab path) -> the Trainable of the run's algorithm.
Builder = Callable[[TrainInputs, Any, TTTLoss, Path], Trainable]

OBJECTIVES: Registry[Builder] = Registry("drafter.algorithm", "train/objectives/ (a module per algorithm)")
