"""How a loss's ``loss_sum`` executes over the K steps (the package docstring says when each runs): per step in
recomputed row chunks through lm_head's own forward (ZeRO-3, :func:`per_step_module_calls`), once per chunk
of teacher rows for all K steps with fp32-result GEMMs (:func:`fp32_head_steps`), or the soft CE's
shared-teacher rewrite (:func:`shared_teacher_steps`)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from fledge.models import alignment
from fledge.models.kernels import draft_cross_entropy, draft_logsumexp, fp32_grad, teacher_expectation
from fledge.models.kernels.head_loss import head_loss_steps


def flat(step: alignment.StepRows) -> alignment.StepRows:
    return alignment.StepRows(step.lead, step.teacher_argmax.reshape(-1), step.counted.reshape(-1),
                              step.scored.reshape(-1))


def partitioned(lm_head) -> bool:
    """ZeRO-3 partitions lm_head's weight and gathers it only inside lm_head's own forward."""
    return hasattr(lm_head.weight, "ds_id")


def fp32_head_steps(loss_sum, ys_flat, rows, th_flat, lm_head, teacher_head, chunk_size):
    """Any ``loss_sum`` per step k, outside ZeRO-3: (summed over its counted rows, those rows, the drafter's
    argmax there), through models/kernels/head_loss.py: fp32 logits, the teacher's computed once per chunk of
    teacher rows for every step, chunks recomputed in backward, lm_head's gradient summed in fp32 through one
    ``fp32_grad`` stand-in. A step without counted rows still gives lm_head a (zero) gradient: every rank
    reduces the same buckets."""

    idx = [s.counted.nonzero().squeeze(1) for s in rows]
    scored = head_loss_steps([y[r] for y, r in zip(ys_flat, idx)], lm_head.weight, th_flat,
                             teacher_head.to(th_flat.dtype), [r + s.lead for r, s in zip(idx, rows)], loss_sum,
                             chunk_size, grad_into=fp32_grad(lm_head.weight))
    return [(total, r, pred if r.numel() else None) for (total, pred), r in zip(scored, idx)]


def shared_teacher_steps(ys_flat, rows, th_flat, lm_head, teacher_head, impl, chunk_size):
    """The soft CE per step k: (summed over its counted rows, those rows, the drafter's argmax there).

    The teacher's expected head row q (models/kernels/fused_loss.py) is computed once for the union of
    the teacher rows any step needs, and each step pays only for its drafter logsumexp. No [rows, Vd]
    tensor outlives a chunk. lm_head's gradient is, per step and for the teacher, a large term of nearly
    the size of its neighbours' with the opposite sign; they all sum in fp32 through one ``fp32_grad``
    stand-in and reach the weight rounded once (rounding each term first loses ~4% near convergence).
    """

    w = lm_head.weight
    w_grad = fp32_grad(w)
    idx = [s.counted.nonzero().squeeze(1) for s in rows]
    wanted = torch.unique(torch.cat([r + s.lead for s, r in zip(rows, idx)]))  # counted => in range
    slot = torch.full((rows[0].counted.numel(),), -1, dtype=torch.long, device=w.device)
    slot[wanted] = torch.arange(wanted.numel(), device=w.device)
    q = teacher_expectation(th_flat[wanted], teacher_head.to(th_flat.dtype), w, chunk_size, grad_into=w_grad)
    out = []
    for y, s, r in zip(ys_flat, rows, idx):
        if r.numel() == 0:  # one weight-0 row keeps lm_head (and y) in every rank's graph
            lse, _ = draft_logsumexp(y[:1], w, impl, chunk_size, grad_into=w_grad)
            out.append((0.0 * lse.sum(), r, None))
            continue
        loss_rows, pred = draft_cross_entropy(y[r], w, q, slot[r + s.lead], impl, chunk_size, grad_into=w_grad)
        out.append((loss_rows.sum(), r, pred))
    return out


def chunk_loss(loss_sum, y, teacher_hidden, lm_head, teacher_head):
    """``loss_sum`` over rows of y (fp32 logits from lm_head's forward) and the drafter's argmax there."""
    logits = lm_head(y).float()
    with torch.no_grad():
        teacher_logits = (teacher_hidden @ teacher_head.T).float()
    return loss_sum(logits, teacher_logits), logits.detach().argmax(-1)


def per_step_module_calls(loss_sum, ys_flat, rows, th_flat, lm_head, teacher_head, chunk_size):
    """The generic path: ``loss_sum`` through lm_head's own forward, step by step, chunk by chunk.

    Chunks tile all B*T positions (only counted rows are computed), so every rank calls lm_head the
    same number of times whatever its mask (ZeRO-3 gathers the weight per call, and every rank needs
    the same graph); an empty chunk computes one row with weight 0. Each chunk's logits live only
    inside a checkpointed function.
    """
    use_ckpt = torch.is_grad_enabled()
    out = []
    for y, s in zip(ys_flat, rows):
        c = s.counted
        total, kept, preds = y.new_zeros((), dtype=torch.float32), [], []
        for a in range(0, c.numel(), chunk_size):
            r = a + c[a : a + chunk_size].nonzero().squeeze(1)
            empty = r.numel() == 0
            rr = r.new_tensor([a]) if empty else r
            args = (loss_sum, y[rr], th_flat[rr if empty else rr + s.lead], lm_head, teacher_head)
            part, pred = checkpoint(chunk_loss, *args, use_reentrant=False) if use_ckpt else chunk_loss(*args)
            total = total + (0.0 * part if empty else part)
            if not empty:
                kept.append(r)
                preds.append(pred)
        r = torch.cat(kept) if kept else c.nonzero().squeeze(1)
        out.append((total, r, torch.cat(preds) if preds else None))
    return out
