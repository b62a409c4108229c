"""Any loss of the drafter's and the teacher's logits over the draft vocab, for all K TTT steps at once:
teacher logits computed once per chunk of teacher rows and shared by the steps, fp32 logits and an fp32
lm_head gradient. train/losses' path outside ZeRO-3 for the losses that have no rewrite of their own
(the soft CE has one: fused_loss.py).

Step k scores drafter row r against teacher row r + 1 + k, so the steps read the same teacher rows. The
teacher rows any step needs are taken in chunks; per chunk, the teacher logits a = t W_t^T are computed once
and every step scores its rows that point into the chunk (a contiguous run of them: a step's teacher rows
ascend with its rows): drafter logits b = y_k W_d^T, the summed loss ``loss_sum(b, a)`` in fp32, and the
drafter's argmax. Both GEMMs have an fp32 result (fp32_accum.py ``mm_f32``). Nothing of [rows, Vd] outlives
its chunk (only y's rows and the row indices are kept for backward): backward recomputes a once per chunk
and b per step, takes d = dL/db by autograd through ``loss_sum``, and forms dy = d W_d and dW_d += d^T y in
fp32. dy is rounded to y's dtype once; dW_d goes to ``grad_into`` (an ``fp32_grad`` stand-in), where every
chunk's and step's terms and the other users' sum in fp32.

Why not per step (as ZeRO-3's path, train/losses/paths.py ``per_step_module_calls``, does): the teacher's GEMMs
then run K times. Measured (scripts/bench_loss.py's shapes on one CPU thread, fp32, N=1024, H=Ht=512,
Vd=8000, K=7, CPU seconds of forward + backward): 2.74 s here against 3.71 s per step for tv, 2.78 s against
3.70 s for the soft CE's formula (whose own rewrite takes 2.73 s). Why fp32 logits: near convergence the
gradient is a small difference of large terms; in bf16 at drafter-teacher KL 0.004 (tests/helpers/loss_precision.py)
logits out of lm_head's bf16 forward and a dW summed in bf16 put the gradients 23-45% off fp64, this path
within 1.5x of fp32 math rounded once (tests/unit/train/test_loss_family.py). The price on CUDA: the fp32 d enters the
bf16 GEMMs of dy and dW in two parts (four GEMMs instead of two).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fledge.models.kernels.fp32_accum import addmm_f32_, fp32_grad, mm_f32

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _pieces(slots: list[torch.Tensor], n_teacher: int, chunk_size: int):
    """Per chunk [c0, c1) of the wanted teacher rows, per step: the run [lo, hi) of its rows pointing there."""
    bounds = [torch.searchsorted(s, torch.arange(0, n_teacher + chunk_size, chunk_size, device=s.device)).tolist()
              for s in slots]
    for j, c0 in enumerate(range(0, n_teacher, chunk_size)):
        yield c0, min(c0 + chunk_size, n_teacher), [(b[j], b[j + 1]) for b in bounds]


class _SharedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_d, w_grad, t, w_t, wanted, loss_sum, chunk_size, slots, *ys):
        totals = [torch.zeros((), dtype=torch.float32, device=w_d.device) for _ in ys]
        args: list[list[torch.Tensor]] = [[] for _ in ys]
        for c0, c1, runs in _pieces(slots, wanted.numel(), chunk_size):
            a = None
            for k, (y, s, (lo, hi)) in enumerate(zip(ys, slots, runs)):
                if hi == lo:
                    continue
                if a is None:
                    a = mm_f32(t.index_select(0, wanted[c0:c1]), w_t.t(), w_t.dtype)
                b = mm_f32(y[lo:hi], w_d.t(), w_d.dtype)
                totals[k] += loss_sum(b, a.index_select(0, s[lo:hi] - c0))
                args[k].append(b.argmax(-1))
        ctx.save_for_backward(w_d, t, w_t, wanted, *slots, *ys)
        ctx.loss_sum, ctx.chunk_size, ctx.steps = loss_sum, chunk_size, len(ys)
        argmax = [torch.cat(a) if a else s.new_zeros(0) for a, s in zip(args, slots)]
        ctx.mark_non_differentiable(*argmax)
        return (*totals, *argmax)

    @staticmethod
    def backward(ctx, *grads):
        w_d, t, w_t, wanted, *rest = ctx.saved_tensors
        slots, ys = rest[:ctx.steps], rest[ctx.steps:]
        need_dw, need_dy = ctx.needs_input_grad[1], ctx.needs_input_grad[8:]
        dys = [torch.zeros(y.shape, device=y.device, dtype=torch.float32) if need else None
               for y, need in zip(ys, need_dy)]
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32) if need_dw else None
        for c0, c1, runs in _pieces(slots, wanted.numel(), ctx.chunk_size):
            a = None
            for k, (y, s, (lo, hi)) in enumerate(zip(ys, slots, runs)):
                if hi == lo or not (need_dw or need_dy[k]):
                    continue
                if a is None:
                    a = mm_f32(t.index_select(0, wanted[c0:c1]), w_t.t(), w_t.dtype)
                b = mm_f32(y[lo:hi].detach(), w_d.t(), w_d.dtype)
                with torch.enable_grad():
                    b.requires_grad_()
                    (d,) = torch.autograd.grad(ctx.loss_sum(b, a.index_select(0, s[lo:hi] - c0)), b)
                d.mul_(grads[k].float())
                if need_dy[k]:
                    addmm_f32_(dys[k][lo:hi], d, w_d, w_d.dtype)
                if need_dw:
                    addmm_f32_(dw, d.t(), y[lo:hi], w_d.dtype)
        # dy holds its terms in fp32: rounded once, here.
        return (None, dw, None, None, None, None, None, None,
                *(dy.to(y.dtype) if dy is not None else None for dy, y in zip(dys, ys)))


def head_loss_steps(ys: list[torch.Tensor], w_d: torch.Tensor, t: torch.Tensor, w_t: torch.Tensor,
                    indices: list[torch.Tensor], loss_sum: LossSum, chunk_size: int = 1024,
                    grad_into: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step k: (``loss_sum`` over the rows of ``ys[k]`` against teacher rows ``t[indices[k]]``, fp32 scalar;
    the argmax of ys[k] W_d^T, int64 per row).

    ys[k] [N_k, H] step k's drafter states, ``indices[k]`` [N_k] the teacher row of each, ascending (a step
    scores its rows against teacher rows that grow with them); w_d [Vd, H] the drafter's lm_head (gets the
    gradient); t [M, Ht] teacher states and w_t [Vd, Ht] the draft-vocab rows of the target's lm_head (both
    frozen). ``loss_sum(b, a)``: the summed loss of fp32 drafter and teacher logits ``[rows, Vd]``,
    differentiable in b (train/losses/divergences.py). ``chunk_size`` teacher rows at a time (so at most that many
    rows of each step). ``grad_into``: the ``fp32_grad(w_d)`` stand-in W_d's gradient goes to; None = one of
    its own. A step without rows gives 0 and zero gradients.
    """
    if len(ys) != len(indices) or not ys:
        raise ValueError(f"head_loss_steps: {len(ys)} steps of states, {len(indices)} of indices: one per step")
    for y, index in zip(ys, indices):
        if y.dim() != 2 or y.shape[1] != w_d.shape[1] or y.dtype != w_d.dtype or index.shape != y.shape[:1]:
            raise ValueError(f"head_loss_steps: y {tuple(y.shape)} {y.dtype}, W_d {tuple(w_d.shape)} {w_d.dtype}, "
                             f"index {tuple(index.shape)}: need y [N, H] in W_d's dtype and index [N]")
    if t.shape[1] != w_t.shape[1] or w_t.shape[0] != w_d.shape[0] or chunk_size < 1:
        raise ValueError(f"head_loss_steps: t {tuple(t.shape)}, W_t {tuple(w_t.shape)}, W_d {tuple(w_d.shape)}, "
                         f"chunk_size={chunk_size}: need t [M, Ht], W_t [Vd, Ht], W_d [Vd, H], chunk_size >= 1")
    wanted = torch.unique(torch.cat(indices))  # sorted: the teacher rows any step reads
    slots = [torch.searchsorted(wanted, index) for index in indices]  # each index's place among them, ascending
    grad_into = fp32_grad(w_d) if grad_into is None else grad_into
    out = _SharedHeadLoss.apply(w_d.detach(), grad_into, t.detach(), w_t.detach(), wanted, loss_sum, chunk_size,
                                slots, *ys)
    return list(zip(out[:len(ys)], out[len(ys):]))
