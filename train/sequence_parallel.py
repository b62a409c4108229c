"""Sequence (context) parallelism of the TTT step: ``train.sequence_parallel=N`` splits each packed row over N
ranks, with DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) for the attention.

The world is data parallel x sequence parallel (fledge/distributed.py ``SequenceGroups``): the N ranks of a
group read the same global batch (the loader sees the group as one data-parallel rank, so the global batch
plan does not change) and each keeps a contiguous shard of every row, ``rows = ceil(T / N)`` positions. What
each rank computes on its shard:

- the drafter's projections, norms, MLP and its loss rows: everything but attention is position-wise;
- attention: Ulysses' all-to-all turns q/k/v ``[B, T/N, H, D]`` (this rank's rows, every head) into
  ``[B, T, H/N, D]`` (every row, this rank's heads) and the output back. The single-rank TTT attention
  (models/attention.py: the memory-linear path on CPU, flex on GPU) then runs unchanged over whole rows,
  with the whole row's document ids as its mask: step-k diagonal keys, document boundaries and causality
  are exactly those of one rank. RoPE is applied before the exchange, at each row's own position. Each TTT
  step exchanges only its new k/v; the earlier steps' keys stay in head-shard form in the step cache.
- the TTT alignment reads up to K+1 rows past a row (step k's input token and teacher are row t+1+k, and
  whether it counts reads row t+2+k), so a shard carries ``halo = K + 1`` rows of the next shard's inputs:
  never run through the drafter, never counted, only read.

The loss of a step is normalised by the rows the whole optimizer step counts, every shard of every group
included (train/losses/base.py ``step_denominators``: one all-reduce of K integers), and scaled by the number of
losses DeepSpeed averages gradients over (grad_accum x all ranks, dp x N), so the step's gradient is that
of one batch holding all its rows. The all-to-all's backward carries every rank's loss
into the others' activations, so each rank's parameter gradient is the whole row's through its own shard,
and the N of them sum to the one-rank gradient (tests/distributed/test_sequence_parallel.py: sp=2 equals
sp=1 in loss and every gradient, EAGLE-3 and 3.1, with a document across the split).

Requires the drafter's ``num_key_value_heads`` divisible by N (each rank attends with whole kv heads and
their query groups). DeepSpeed is imported only when N > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fledge.data.features.batch import FeatureBatch
from fledge.distributed import SequenceGroups, all_reduce_sum, backend

KEY = "train.sequence_parallel"
_PAD = {"input_ids": 0, "loss_mask": False, "target_argmax": 0, "position_ids": 0, "document_ids": -1}  # floats: 0


def check_heads(size: int, num_key_value_heads: int, num_attention_heads: int) -> None:
    """ValueError naming the key unless every rank of a group gets whole kv heads."""
    if num_key_value_heads % size:
        raise ValueError(f"{KEY}={size} must divide the drafter's num_key_value_heads={num_key_value_heads} "
                         f"(num_attention_heads={num_attention_heads}; the drafter's heads are the target's): "
                         f"Ulysses gives each rank whole heads; use a divisor of {num_key_value_heads}")


@dataclass
class RowShard:
    """One rank's part of a batch: ``batch`` holds rows [start, start + rows + halo) of every per-position
    tensor (padded past the row's end), of which the first ``rows`` are this rank's; ``document_ids`` are
    the whole (padded) rows', ``[B, N * rows]``: the attention's mask."""

    batch: FeatureBatch
    document_ids: torch.Tensor
    rows: int
    sp: SequenceParallel

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> RowShard:
        return RowShard(self.batch.to(device, dtype), self.document_ids.to(device), self.rows, self.sp)

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank's own rows (summed over the group: the batch's)."""
        return int((self.batch.document_ids[:, : self.rows] >= 0).sum())


class SequenceParallel:
    """This rank's place in its sequence-parallel group and the operations on it: :meth:`split` a batch,
    :meth:`distribute` the attention (the wrapper the drafter's ``ttt_step`` takes), :meth:`group_sum`."""

    def __init__(self, groups: SequenceGroups, steps: int) -> None:
        self.size, self.rank, self.group = groups.size, groups.rank, groups.group
        self.halo = steps + 1  # alignment: row t reads rows up to t + lead(K-1) + 1 = t + K + 1
        self._ulysses_ready = False

    def split(self, batch: FeatureBatch) -> RowShard:
        """This rank's shard of ``batch`` (taken before it moves to the device: only the shard does)."""
        T = batch.input_ids.shape[1]
        rows = -(-T // self.size)
        start, width = self.rank * rows, rows + self.halo
        parts = {}
        for f in fields(batch):
            t = getattr(batch, f.name)
            parts[f.name] = _pad_to(t[:, start:start + width], width, _PAD.get(f.name, 0))
        return RowShard(FeatureBatch(**parts), _pad_to(batch.document_ids, self.size * rows, -1), rows, self)

    def distribute(self, attend):
        """Wrap the drafter's single-rank ``attend(q, k, v)`` (``[B, H, rows, D]`` in and out) in
        DeepSpeed-Ulysses: inside, ``attend`` sees ``[B, H/N, N * rows, D]``."""
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        if not self._ulysses_ready:  # its all-to-all runs on deepspeed.comm, over Fledge's process group
            deepspeed.init_distributed(dist_backend=backend(), dist_init_required=False)
            self._ulysses_ready = True

        def heads(q, k, v):  # [B, N*rows, H/N, D] -> the drafter's layout and back
            t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
            return attend(t(q), t(k), t(v)).transpose(1, 2)

        ulysses = DistributedAttention(heads, self.group, scatter_idx=2, gather_idx=1)

        def wrapped(q, k, v):
            return ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0).transpose(1, 2)

        return wrapped

    def group_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over this group (not differentiable: counts)."""
        return all_reduce_sum(x, group=self.group)


def _pad_to(t: torch.Tensor, length: int, fill) -> torch.Tensor:
    """``t`` along dim 1 cut or padded with ``fill`` to ``length``."""
    n = t.shape[1]
    if n >= length:
        return t[:, :length]
    pad = torch.full((t.shape[0], length - n, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)
