"""The module DeepSpeed wraps: the drafter plus the frozen teacher head, forward = the algorithm's objective.

Wrapping keeps every parameter access inside a submodule's forward, which is what ZeRO-3's
gather hooks need; the teacher head (rows of the target's lm_head) is a frozen,
non-persistent buffer, so checkpoints hold only the drafter (under the ``drafter.`` prefix).
Each algorithm builds its drafter, teacher head and objective in its own module (train/objectives/),
registered in ``OBJECTIVES``; :func:`build_ttt_model` looks the run's up.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fledge.data.features.batch import FeatureBatch
from fledge.models.algorithms import algorithm_of
from fledge.stage_inputs import TrainInputs
from fledge.train.losses import TTTResult, build_loss, step_denominators
from fledge.train.objectives import OBJECTIVES, Objective
from fledge.train.sequence_parallel import RowShard


class TTTModel(nn.Module):
    """``forward(batch)`` = ``loss(drafter, batch, teacher_head)``: a ``TTTResult`` (train/losses). ``loss`` is the
    algorithm's objective (train/objectives/base.py ``Objective``: a registered TTT loss for EAGLE)."""

    PREFIX = "drafter."

    def __init__(self, drafter: nn.Module, teacher_head: torch.Tensor, loss: Objective) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("teacher_head", teacher_head, persistent=False)
        self.loss = loss

    def forward(self, batch: FeatureBatch | RowShard, denominators: torch.Tensor | None = None) -> TTTResult:
        """A ``RowShard`` (train/sequence_parallel.py) is one rank's part of a row split over its group;
        ``denominators``: the optimizer step's, from :meth:`step_denominators` (None: ``batch`` is the
        whole step)."""
        if isinstance(batch, RowShard):
            return self.loss(self.drafter, batch.batch, self.teacher_head, shard=batch, denominators=denominators)
        return self.loss(self.drafter, batch, self.teacher_head, denominators=denominators)

    def step_denominators(self, batches: list[FeatureBatch | RowShard], divisor: float) -> torch.Tensor:
        """The loss denominators of one optimizer step whose micro-batches on this rank are ``batches`` (on
        any device; counted before they move to it), ``divisor`` the number of micro-batch losses the
        optimizer averages (train/deepspeed_setup.py ``gradient_divisor``); train/losses/base.py ``step_denominators``.
        Every rank calls it once per step, before the step's first forward."""
        counts = sum(self.loss.counted_rows(self.drafter, b.batch, shard=b) if isinstance(b, RowShard)
                     else self.loss.counted_rows(self.drafter, b) for b in batches)
        return step_denominators(counts, divisor)

    def cast_teacher(self, dtype: torch.dtype) -> None:
        """DeepSpeed's bf16 mode casts parameters, not buffers: match the teacher head to the compute
        dtype once (its logits are upcast to fp32 before the softmax in the loss)."""
        self.teacher_head = self.teacher_head.to(dtype)


def build_ttt_model(inputs: TrainInputs, vocab_path: Path, device: torch.device) -> TTTModel:
    """The run's algorithm's drafter, teacher head and objective (train/objectives/, from the target's config, the
    prepared draft vocab at ``vocab_path`` and the target's weights, read without instantiating the target), on
    ``device``."""
    from transformers import AutoConfig

    if inputs.drafter.norm_impl == "triton" and device.type != "cuda":
        raise ValueError(f"drafter.norm_impl=triton runs a CUDA kernel but training runs on {device.type}; "
                         "use drafter.norm_impl=torch")
    loss = build_loss(inputs.drafter)  # an unknown drafter.loss fails before any weight is read
    builder = OBJECTIVES.get(algorithm_of(inputs.drafter).name)
    t = inputs.target
    hf_config = AutoConfig.from_pretrained(t.name_or_path, revision=t.revision, trust_remote_code=t.trust_remote_code)
    trainable = builder(inputs, hf_config, loss, vocab_path)
    return TTTModel(trainable.drafter, trainable.teacher_head, trainable.objective).to(device)
