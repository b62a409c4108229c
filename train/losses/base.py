"""What every training loss shares: the K-step unroll, which rows count at each step and against which teacher
row (models/alignment.py), the step weights, the metrics and the registry ``drafter.loss`` selects from; a
loss itself writes ``loss_sum`` only (objectives.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from fledge.conf.drafter_rules import drafter_problems, raise_problems
from fledge.data.features.batch import FeatureBatch
from fledge.distributed import all_reduce_sum
from fledge.models import alignment
from fledge.models.alignment import step_key
from fledge.registry import Registry
from fledge.train.losses import paths


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, sum_k w^k L_k, for backward
    # name -> (numerator, denominator), float64, detached: loss_k, acc_k, full_acc_k for k = 0..K-1.
    # Sum both over ranks / micro-batches, then divide.
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]


class TTTLoss(ABC):
    """A TTT loss: ``loss_sum`` (the formula) plus the unroll, alignment, step weights and metrics.

    ``steps`` is K, ``step_weight`` w, ``chunk_size`` the rows per chunk of logits, ``impl`` the
    shared-teacher path's implementation (auto: Triton on CUDA; torch). Call it as
    ``loss(drafter, batch, teacher_head)``; ``teacher_head`` ``[Vd, Ht]`` holds the draft-vocab rows of the
    target's lm_head in draft-id order.
    """

    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()  # the drafter.loss_options fields the constructor takes

    def __init__(self, *, steps: int, step_weight: float, chunk_size: int, impl: str = "auto") -> None:
        raise_problems(drafter_problems(ttt_steps=steps))
        if chunk_size < 1:
            raise ValueError(f"drafter.loss_chunk_size={chunk_size}: must be >= 1")
        if impl not in ("auto", "torch"):
            raise ValueError(f"drafter.loss_impl={impl!r}: expected auto | torch")
        self.steps, self.step_weight, self.chunk_size, self.impl = steps, step_weight, chunk_size, impl

    @abstractmethod
    def loss_sum(self, logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """The loss summed over rows: fp32 scalar from the drafter's ``logits`` and the teacher's
        ``teacher_logits`` (both fp32 ``[rows, Vd]``; the teacher's carry no gradient)."""

    @classmethod
    def from_config(cls, drafter_cfg) -> TTTLoss:
        """This loss with ``drafter_cfg``'s (a ``DrafterConfig``) K, w, chunk size, impl and options."""
        return cls(**_base_args(drafter_cfg), **{k: getattr(drafter_cfg.loss_options, k) for k in cls.options})

    def shared_teacher_sums(self, ys_flat, rows, th_flat, lm_head, teacher_head):
        """An optional rewrite outside ZeRO-3, with the generic path's result: per step, (summed loss over
        its counted rows, those flat row indices, the drafter's argmax at them); None = the fp32-head path."""
        return None

    def __call__(self, drafter, batch: FeatureBatch, teacher_head: torch.Tensor, shard=None,
                 denominators: torch.Tensor | None = None) -> TTTResult:
        """Unroll ``self.steps`` TTT steps of ``drafter`` on ``batch`` and score them: returns the weighted
        loss ``sum_k w^k S_k / denominators[k]`` (S_k the summed loss of step k's counted rows) and
        numerator/denominator metrics: ``loss_k`` over step k's counted rows, ``acc_k`` over its scored
        rows (models/alignment.py: a teacher argmax outside the draft vocab is a miss), ``full_acc_k`` over
        the rows whose steps 0..k are all scored, right when all of them are.

        ``denominators`` (``[K]``): the trainer's, from :func:`step_denominators`, so that an optimizer
        step of many micro-batches on many ranks trains on the mean over all of their rows. None: this
        batch is the whole optimizer step, L_k the mean over its counted rows.

        ``shard`` (sequence parallelism, train/sequence_parallel.py; None on one rank): ``batch`` is one
        rank's shard plus halo; only its own rows count, and without ``denominators`` L_k is normalised by
        the rows the whole group counts and scaled by the group size (DeepSpeed averages gradients over
        every rank): :func:`step_denominators` for a group that is the whole step."""
        Vd = drafter.spec.draft_vocab_size
        if teacher_head.shape[0] != Vd:
            raise ValueError(f"teacher_head has {teacher_head.shape[0]} rows; drafter.draft_vocab_size={Vd}")
        B, T = batch.input_ids.shape
        th_flat = batch.target_hidden.reshape(B * T, -1)
        ys = alignment.ttt_states(drafter, batch, self.steps, shard)
        rows = [paths.flat(s) for s in self._step_rows(drafter, batch, shard)]
        ys_flat = [y.reshape(B * T, -1) for y in ys]
        if paths.partitioned(drafter.lm_head):  # under ZeRO-3 only lm_head's own forward sees its weight
            scored = paths.per_step_module_calls(self.loss_sum, ys_flat, rows, th_flat, drafter.lm_head, teacher_head,
                                            self.chunk_size)
        else:
            scored = self.shared_teacher_sums(ys_flat, rows, th_flat, drafter.lm_head, teacher_head)
            if scored is None:
                scored = paths.fp32_head_steps(self.loss_sum, ys_flat, rows, th_flat, drafter.lm_head, teacher_head,
                                          self.chunk_size)
        return self._weigh(drafter, rows, scored, ys[0].device, shard, denominators)

    def counted_rows(self, drafter, batch: FeatureBatch, shard=None) -> torch.Tensor:
        """Per step k, how many rows of ``batch`` step k's loss trains on (``[K]`` int64, on the batch's
        device; with ``shard``, this rank's own rows): summed over an optimizer step's micro-batches, what
        :func:`step_denominators` takes."""
        return torch.stack([s.counted.sum() for s in self._step_rows(drafter, batch, shard)])

    def _step_rows(self, drafter, batch: FeatureBatch, shard=None) -> list[alignment.StepRows]:
        t2d = drafter.t2d.to(batch.loss_mask.device)  # the trainer counts a step's rows before they move
        rows = [alignment.step_rows(batch.loss_mask, batch.document_ids, batch.target_argmax, t2d, k)
                for k in range(self.steps)]
        if shard is not None:
            for s in rows:  # the halo: the next shard's rows
                s.counted[:, shard.rows:] = False
                s.scored[:, shard.rows:] = False
        return rows

    def _weigh(self, drafter, rows, scored, device, shard=None, denominators=None) -> TTTResult:
        total = torch.zeros((), dtype=torch.float32, device=device)
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        chain_scored = chain_right = None
        f64 = lambda x: x.detach().to(torch.float64)  # noqa: E731
        counts = torch.stack([s.counted.sum() for s in rows])
        if denominators is None:  # this batch is the optimizer step: on one rank, or on one group of N
            counts_of_step = counts if shard is None else shard.sp.group_sum(counts) / shard.sp.size
            denominators = nonzero_denominators(counts_of_step)
        denominators = denominators.to(device, torch.float32)
        for k, (step, (loss_sum, r, pred)) in enumerate(zip(rows, scored)):
            right = torch.zeros_like(step.counted)
            if pred is not None:
                right[r] = drafter.draft_to_target(pred) == step.teacher_argmax[r]
            n = counts[k]
            total = total + self.step_weight**k * loss_sum / denominators[k]
            # scored rows outside the loss (teacher argmax outside the draft vocab) stay misses (alignment.py)
            chain_scored = step.scored if chain_scored is None else chain_scored & step.scored
            chain_right = right if chain_right is None else chain_right & right
            metrics[step_key("loss", k)] = (f64(loss_sum), f64(n))
            metrics[step_key("acc", k)] = (f64(right.sum()), f64(step.scored.sum()))
            metrics[step_key("full_acc", k)] = (f64((chain_right & chain_scored).sum()), f64(chain_scored.sum()))
        return TTTResult(loss=total, metrics=metrics)


def step_denominators(counts: torch.Tensor, divisor: float) -> torch.Tensor:
    """What every micro-batch of an optimizer step divides step k's summed loss S_k by (``[K]`` float64,
    the same on every rank): ``N_k / divisor``. ``counts``: this rank's :meth:`TTTLoss.counted_rows`
    summed over its micro-batches of the step; N_k is their sum over every rank (one all-reduce, so every
    rank calls this). ``divisor``: how many micro-batch losses the optimizer's gradient is the mean of
    (train/deepspeed_setup.py ``gradient_divisor``: DeepSpeed's grad_accum x data-parallel world).

    Then the gradient the optimizer sees is that of ``sum_k w^k (sum of S_k over every micro-batch and
    rank) / N_k``: the loss of one batch holding all of the step's rows, each row weighing the same
    however the rows fall into micro-batches and ranks (a micro-batch's own mean would weigh one of 50
    rows as much as one of 5,000). A step with no counted row at k divides by 1 (its S_k is 0)."""
    return nonzero_denominators(all_reduce_sum(counts.detach().to(torch.float64)) / divisor)


def nonzero_denominators(denominators: torch.Tensor) -> torch.Tensor:
    """``denominators`` with each 0 made 1: a step (or block offset) with no counted row has a summed loss of 0."""
    return torch.where(denominators > 0, denominators, torch.ones_like(denominators))


LOSSES: Registry[type[TTTLoss]] = Registry("drafter.loss", "train/losses/objectives.py")


def register_loss(name: str):
    """Class decorator: make a :class:`TTTLoss` subclass selectable as ``drafter.loss=<name>``."""

    def add(cls: type[TTTLoss]) -> type[TTTLoss]:
        LOSSES.register(name, cls)
        cls.name = name
        return cls

    return add


def check_loss_config(drafter_cfg) -> None:
    """ValueError unless ``drafter_cfg`` (a ``DrafterConfig``) selects a loss that can be built: its name and,
    for ``mix``, every name in ``drafter.loss_mix`` registered (the schema checks the values; it cannot see
    the registry)."""
    build_loss(drafter_cfg)


def build_loss(drafter_cfg) -> TTTLoss:
    """The loss ``drafter_cfg`` (a ``DrafterConfig``) selects, with its K, w, chunk size, impl and options."""
    return LOSSES.get(drafter_cfg.loss).from_config(drafter_cfg)


def _base_args(drafter_cfg) -> dict:
    return dict(steps=drafter_cfg.ttt_steps, step_weight=drafter_cfg.step_weight,
                chunk_size=drafter_cfg.loss_chunk_size, impl=drafter_cfg.loss_impl)
