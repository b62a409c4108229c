"""Training-time-test loss (SPEC.md section 4): K unrolled draft steps against the target's teacher.

Alignment, from an unshifted ``FeatureBatch`` (index t = token x_t and the target's state after it):
step k, row t gets token x_{t+1+k} at RoPE position ``position_ids[t] + k``, feature ``A_t`` (step 0) or
the fed-back state of step k-1 at row t, and is scored against the teacher ``P_{t+1+k}`` (from
``target_hidden[t+1+k]``, the distribution of x_{t+2+k}). Row t of step k counts when x_{t+2+k} is a
loss-masked token of the same document as t and the target's argmax at t+1+k lies in the draft vocab.

The teacher is computed from the target's final normed state and only the draft-vocab rows of its
``lm_head``, over counted rows only, in chunks of ``chunk_size`` rows that are recomputed in backward,
so [rows, Vd] fp32 tensors never accumulate over chunks or steps. Since step k reads teacher row t+1+k,
the steps share teacher rows and the teacher is computed once per batch, not once per step
(``_shared_teacher_steps``; on CUDA the drafter side runs the Triton kernel). Under ZeRO-3, whose
lm_head weight exists only inside lm_head's forward, the loss goes step by step through that forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fledge.data.batch import FeatureBatch


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


def _partitioned(lm_head) -> bool:
    """ZeRO-3 partitions lm_head's weight and gathers it only inside lm_head's own forward."""
    return hasattr(lm_head.weight, "ds_id")


def _shared_teacher_steps(ys_flat, counted, th_flat, lm_head, teacher_head, impl, chunk_size):
    """Per step k: (summed soft cross-entropy over its counted rows, those rows, the drafter's argmax).

    Row t of step k is scored against teacher row t+1+k, so the steps share teacher rows: the teacher's
    expected head row q (models/kernels/fused_loss.py) is computed once for the union of the rows any
    step needs, and each step pays only for its drafter logsumexp. No [rows, Vd] tensor outlives a chunk.
    """
    from fledge.models.kernels import draft_logsumexp, gather_dot, teacher_expectation

    w = lm_head.weight
    rows = [c.nonzero().squeeze(1) for c in counted]
    wanted = torch.unique(torch.cat([r + 1 + k for k, r in enumerate(rows)]))  # counted => in range
    slot = torch.full((counted[0].numel(),), -1, dtype=torch.long, device=w.device)
    slot[wanted] = torch.arange(wanted.numel(), device=w.device)
    q = teacher_expectation(th_flat[wanted], teacher_head.to(th_flat.dtype), w, chunk_size)
    out = []
    for k, (y, r) in enumerate(zip(ys_flat, rows)):
        if r.numel() == 0:  # one weight-0 row keeps lm_head (and y) in every rank's graph
            lse, _ = draft_logsumexp(y[:1], w, impl, chunk_size)
            out.append((0.0 * lse.sum(), r, None))
            continue
        yr = y[r]
        lse, pred = draft_logsumexp(yr, w, impl, chunk_size)
        out.append(((lse - gather_dot(yr, q, slot[r + 1 + k])).sum(), r, pred))
    return out


def _chunk_loss(y, teacher_hidden, lm_head, teacher_head):
    """Soft cross-entropy summed over rows (fp32) and the drafter's argmax (draft ids) for rows of y."""
    logits = lm_head(y).float()
    with torch.no_grad():
        teacher = F.softmax((teacher_hidden @ teacher_head.T).float(), dim=-1)  # renormalised over Vd
    loss = -(teacher * F.log_softmax(logits, dim=-1)).sum()
    return loss, logits.detach().argmax(-1)


def _per_step_module_calls(ys_flat, counted, th_flat, lm_head, teacher_head, chunk_size):
    """The ZeRO-3 path: the same sums through lm_head's own forward, step by step, chunk by chunk.

    Chunks tile all B*T positions (only counted rows are computed), so every rank calls lm_head the
    same number of times whatever its mask (ZeRO-3 gathers the weight per call, and every rank needs
    the same graph); an empty chunk computes one row with weight 0. Each chunk's logits live only
    inside a checkpointed function.
    """
    use_ckpt = torch.is_grad_enabled()
    out = []
    for k, (y, c) in enumerate(zip(ys_flat, counted)):
        loss_sum, rows, preds = y.new_zeros((), dtype=torch.float32), [], []
        for a in range(0, c.numel(), chunk_size):
            r = a + c[a : a + chunk_size].nonzero().squeeze(1)
            empty = r.numel() == 0
            rr = r.new_tensor([a]) if empty else r
            args = (y[rr], th_flat[rr if empty else rr + 1 + k], lm_head, teacher_head)
            part, pred = checkpoint(_chunk_loss, *args, use_reentrant=False) if use_ckpt else _chunk_loss(*args)
            loss_sum = loss_sum + (0.0 * part if empty else part)
            if not empty:
                rows.append(r)
                preds.append(pred)
        r = torch.cat(rows) if rows else c.nonzero().squeeze(1)
        out.append((loss_sum, r, torch.cat(preds) if preds else None))
    return out


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
    if loss_impl not in ("auto", "torch"):
        raise ValueError(f"drafter.loss_impl={loss_impl!r}: expected auto | torch")
    B, T = batch.input_ids.shape
    doc = batch.document_ids
    valid = doc >= 0
    th_flat = batch.target_hidden.reshape(B * T, -1)

    ys = ttt_states(drafter, batch, steps)
    teacher_argmax = [_shift(batch.target_argmax, 1 + k, 0).reshape(-1) for k in range(steps)]
    counted = [
        (valid & _shift(batch.loss_mask, 2 + k, False) & (_shift(doc, 2 + k, -2) == doc)).reshape(-1)
        & drafter.t2d[teacher_argmax[k]]
        for k in range(steps)
    ]
    ys_flat = [y.reshape(B * T, -1) for y in ys]
    if _partitioned(drafter.lm_head):
        scored = _per_step_module_calls(ys_flat, counted, th_flat, drafter.lm_head, teacher_head, chunk_size)
    else:
        impl = "auto" if loss_impl == "auto" else "chunked"
        scored = _shared_teacher_steps(ys_flat, counted, th_flat, drafter.lm_head, teacher_head, impl, chunk_size)

    total = ys[0].new_zeros((), dtype=torch.float32)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    chain_counted = chain_right = None
    for k, (loss_sum, r, pred) in enumerate(scored):
        right = torch.zeros(B * T, dtype=torch.bool, device=ys[0].device)
        if pred is not None:
            right[r] = drafter.draft_to_target(pred) == teacher_argmax[k][r]
        counted_k = counted[k]
        n = counted_k.sum()
        total = total + step_weight**k * loss_sum / n.clamp(min=1)
        chain_counted = counted_k if chain_counted is None else chain_counted & counted_k
        chain_right = right if chain_right is None else chain_right & right
        f64 = lambda x: x.detach().to(torch.float64)  # noqa: E731
        metrics[f"loss_{k}"] = (f64(loss_sum), f64(n))
        metrics[f"acc_{k}"] = (f64(right.sum()), f64(n))
        metrics[f"full_acc_{k}"] = (f64((chain_right & chain_counted).sum()), f64(chain_counted.sum()))
    return TTTResult(loss=total, metrics=metrics)
