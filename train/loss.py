"""Training-time-test loss (SPEC.md section 4): K unrolled draft steps against the target's teacher.

Alignment, from an unshifted ``FeatureBatch`` (index t = token x_t and the target's state after it):
step k, row t gets token x_{t+1+k} at RoPE position ``position_ids[t] + k``, feature ``A_t`` (step 0) or
the fed-back state of step k-1 at row t, and is scored against the teacher ``P_{t+1+k}`` (from
``target_hidden[t+1+k]``, the distribution of x_{t+2+k}). Row t of step k counts when x_{t+2+k} is a
loss-masked token of the same document as t and the target's argmax at t+1+k lies in the draft vocab.

The teacher is computed from the target's final normed state and only the draft-vocab rows of its
``lm_head``, over the counted rows only, in chunks of ``chunk_size`` rows; each chunk's logits live
only inside a checkpointed function (recomputed in backward), so [rows, Vd] fp32 tensors never
accumulate over chunks or steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from data.batch import FeatureBatch


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, sum_k w^k L_k, for backward
    # name -> (numerator, denominator), float64, detached: loss_k, acc_k, full_acc_k for k = 0..K-1.
    # Sum both over ranks / micro-batches, then divide.
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """``out[:, t] = x[:, t + s]``, ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def ttt_states(drafter, batch: FeatureBatch, steps: int) -> list[torch.Tensor]:
    """Unroll ``steps`` TTT steps (teacher forcing); returns y_k = norm(h2) ``[B, T, H]`` per step.

    Step k row t: token x_{t+1+k}, RoPE position ``position_ids[t] + k``, feature ``fuse(A_t)`` at step
    0 and the fed-back state of step k-1 after. ``drafter.lm_head(y_k)`` are the step's logits.
    """
    g = drafter.fuse(batch.aux_hidden)
    kv: list = []
    ys = []
    for k in range(steps):
        y, g = drafter.ttt_step(_shift(batch.input_ids, 1 + k, 0), g, batch.position_ids + k, batch.document_ids, kv)
        ys.append(y)
    return ys


def _use_kernel(y: torch.Tensor, lm_head, loss_impl: str) -> bool:
    """The fused Triton loss runs on CUDA when lm_head's weight is whole (ZeRO-3 partitions it and
    gathers it only inside lm_head's own forward, so there the torch path runs)."""
    if loss_impl not in ("auto", "torch"):
        raise ValueError(f"drafter.loss_impl={loss_impl!r}: expected auto | torch")
    return loss_impl == "auto" and y.is_cuda and not hasattr(lm_head.weight, "ds_id")


def _kernel_loss(y, teacher_hidden, lm_head, teacher_head):
    """Same contract as _chunk_loss, streamed over vocab blocks: no [rows, Vd] tensor exists."""
    from models.kernels import fused_draft_loss

    m = torch.ones(y.shape[0], device=y.device, dtype=torch.float32)
    return fused_draft_loss(y, lm_head.weight, teacher_hidden, teacher_head.to(teacher_hidden.dtype), m,
                            impl="triton")


def _chunk_loss(y, teacher_hidden, lm_head, teacher_head):
    """Soft cross-entropy summed over rows (fp32) and the drafter's argmax (draft ids) for rows of y."""
    logits = lm_head(y).float()
    with torch.no_grad():
        teacher = F.softmax((teacher_hidden @ teacher_head.T).float(), dim=-1)  # renormalised over Vd
    loss = -(teacher * F.log_softmax(logits, dim=-1)).sum()
    return loss, logits.detach().argmax(-1)


def ttt_loss(
    drafter,
    batch: FeatureBatch,
    teacher_head: torch.Tensor,
    *,
    steps: int,
    step_weight: float,
    chunk_size: int,
    loss_impl: str = "auto",
) -> TTTResult:
    """Unroll ``steps`` TTT steps of ``drafter`` (an ``Eagle3Drafter``) on ``batch`` and score them.

    ``teacher_head`` ``[Vd, Ht]`` holds the draft-vocab rows of the target's ``lm_head`` (frozen), in
    draft-id order. Returns the weighted loss ``sum_k step_weight**k * L_k`` (L_k: mean over counted
    rows; 0 when none) and numerator/denominator metrics; ``full_acc_k`` counts rows whose steps 0..k
    are all counted, and is right when all of them are.
    """
    if steps < 1:
        raise ValueError(f"drafter.ttt_steps={steps}: must be >= 1")
    if chunk_size < 1:
        raise ValueError(f"drafter.loss_chunk_size={chunk_size}: must be >= 1")
    Vd = drafter.spec.draft_vocab_size
    if teacher_head.shape[0] != Vd:
        raise ValueError(f"teacher_head has {teacher_head.shape[0]} rows; drafter.draft_vocab_size={Vd}")
    B, T = batch.input_ids.shape
    doc = batch.document_ids
    valid = doc >= 0
    th_flat = batch.target_hidden.reshape(B * T, -1)
    use_kernel = _use_kernel(batch.target_hidden, drafter.lm_head, loss_impl)
    use_ckpt = torch.is_grad_enabled() and not use_kernel
    chunk_fn = _kernel_loss if use_kernel else _chunk_loss

    ys = ttt_states(drafter, batch, steps)
    total = ys[0].new_zeros((), dtype=torch.float32)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    chain_counted = chain_right = None
    for k, y in enumerate(ys):
        teacher_argmax = _shift(batch.target_argmax, 1 + k, 0)
        counted = (
            valid
            & _shift(batch.loss_mask, 2 + k, False)
            & (_shift(doc, 2 + k, -2) == doc)
            & drafter.t2d[teacher_argmax]
        ).reshape(-1)
        y_flat = y.reshape(B * T, -1)
        loss_sum = y.new_zeros((), dtype=torch.float32)
        right = torch.zeros(B * T, dtype=torch.bool, device=y.device)
        # Chunks tile all B*T positions (only counted rows are computed), so every rank calls lm_head
        # the same number of times whatever its mask: ZeRO-3 gathers lm_head per call and ZeRO-2 reduces
        # gradients in bucket order, and both need the same graph on every rank. An empty chunk
        # computes one row with weight 0 to keep lm_head (and y) in the graph.
        for a in range(0, B * T, chunk_size):
            r = a + counted[a : a + chunk_size].nonzero().squeeze(1)
            empty = r.numel() == 0
            if empty:
                r = r.new_tensor([a])
            # teacher of row t at step k is the target's state at t+1+k (same batch row; counted => in range)
            tr = r if empty else r + 1 + k
            args = (y_flat[r], th_flat[tr], drafter.lm_head, teacher_head)
            part, pred = checkpoint(chunk_fn, *args, use_reentrant=False) if use_ckpt else chunk_fn(*args)
            if empty:
                loss_sum = loss_sum + 0.0 * part
                continue
            loss_sum = loss_sum + part
            right[r] = drafter.draft_to_target(pred) == teacher_argmax.reshape(-1)[r]
        n = counted.sum()
        total = total + step_weight**k * loss_sum / n.clamp(min=1)
        chain_counted = counted if chain_counted is None else chain_counted & counted
        chain_right = right if chain_right is None else chain_right & right
        f64 = lambda x: x.detach().to(torch.float64)  # noqa: E731
        metrics[f"loss_{k}"] = (f64(loss_sum), f64(n))
        metrics[f"acc_{k}"] = (f64(right.sum()), f64(n))
        metrics[f"full_acc_{k}"] = (f64((chain_right & chain_counted).sum()), f64(chain_counted.sum()))
    return TTTResult(loss=total, metrics=metrics)
