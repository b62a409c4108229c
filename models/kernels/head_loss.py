"""Any loss of the drafter's and the teacher's logits over the draft vocab, through fp32 logits and an fp32
lm_head gradient, chunk by chunk: train/loss.py's path outside ZeRO-3 for the losses that have no rewrite
of their own (the soft CE has one: fused_loss.py).

Per chunk of rows: drafter logits b = y W_d^T and teacher logits a = t W_t^T from GEMMs with an fp32 result
(fp32_accum.py ``mm_f32``), the chunk's summed loss ``loss_sum(b, a)`` in fp32, and the drafter's argmax.
Nothing of [rows, Vd] outlives its chunk (only y's rows and the teacher row indices are kept for backward):
backward recomputes b and a, takes d = dL/db of the chunk by autograd through ``loss_sum``, and forms
dy = d W_d and dW_d += d^T y in fp32. dy is rounded to y's dtype once; dW_d goes to ``grad_into`` (an
``fp32_grad`` stand-in), where every chunk's, every step's and the other users' terms sum in fp32.

Why beside ZeRO-3's path (train/loss.py ``_per_step_module_calls``: logits from lm_head's own forward,
rounded to the parameters' dtype, and one rounded dW term per chunk and step): near convergence the
gradient is a small difference of large terms, and in bf16 at drafter-teacher KL 0.004
(tests/loss_precision.py) that path's gradients were measured 24% (dy) and 32% (dW) off fp64, this one's
within 1.5x of fp32 math rounded once (tests/unit/test_loss_family.py). The price: on CUDA, bf16 GEMMs of
the fp32 d split into two parts (four GEMMs for dy and dW instead of two).
"""

from __future__ import annotations

from typing import Callable

import torch

from fledge.models.kernels.fp32_accum import addmm_f32_, fp32_grad, mm_f32

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _logits(y, w_d, t, w_t, index):
    return mm_f32(y, w_d.t(), w_d.dtype), mm_f32(t.index_select(0, index), w_t.t(), w_t.dtype)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_d, w_grad, t, w_t, index, loss_sum, chunk_size):
        total = torch.zeros((), dtype=torch.float32, device=y.device)
        args = []
        for i in range(0, y.shape[0], chunk_size):
            b, a = _logits(y[i:i + chunk_size], w_d, t, w_t, index[i:i + chunk_size])
            total += loss_sum(b, a)
            args.append(b.argmax(-1))
        argmax = torch.cat(args) if args else index.new_zeros(0)
        ctx.save_for_backward(y, w_d, t, w_t, index)
        ctx.loss_sum, ctx.chunk_size = loss_sum, chunk_size
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, t, w_t, index = ctx.saved_tensors
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        dy = torch.zeros(y.shape, device=y.device, dtype=torch.float32) if need_dy else None
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32) if need_dw else None
        for i in range(0, y.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            b, a = _logits(y[s].detach(), w_d, t, w_t, index[s])
            with torch.enable_grad():
                b.requires_grad_()
                (d,) = torch.autograd.grad(ctx.loss_sum(b, a), b)
            d.mul_(grad.float())
            if need_dy:
                addmm_f32_(dy[s], d, w_d, w_d.dtype)
            if need_dw:
                addmm_f32_(dw, d.t(), y[s], w_d.dtype)
        return (dy.to(y.dtype) if need_dy else None), None, dw, None, None, None, None, None


def head_loss(y: torch.Tensor, w_d: torch.Tensor, t: torch.Tensor, w_t: torch.Tensor, index: torch.Tensor,
              loss_sum: LossSum, chunk_size: int = 1024,
              grad_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``loss_sum`` over the rows of y against teacher rows ``t[index]``, fp32 scalar; the argmax of
    y W_d^T, [N] int64).

    y [N, H] drafter states, w_d [Vd, H] the drafter's lm_head (gets the gradient), t [M, Ht] teacher states
    and w_t [Vd, Ht] the draft-vocab rows of the target's lm_head (both frozen), index [N] the teacher row of
    each y row. ``loss_sum(b, a)``: the summed loss of fp32 drafter and teacher logits ``[rows, Vd]``,
    differentiable in b (train/divergences.py). ``chunk_size`` rows at a time, forward and backward.
    ``grad_into``: the ``fp32_grad(w_d)`` stand-in W_d's gradient goes to (shared with other users of W_d in
    the same loss); None = one of its own.
    """
    if y.dim() != 2 or w_d.dim() != 2 or y.shape[1] != w_d.shape[1] or y.dtype != w_d.dtype \
            or t.shape[1] != w_t.shape[1] or w_t.shape[0] != w_d.shape[0] or index.shape != y.shape[:1]:
        raise ValueError(f"head_loss: y {tuple(y.shape)} {y.dtype}, W_d {tuple(w_d.shape)} {w_d.dtype}, t "
                         f"{tuple(t.shape)}, W_t {tuple(w_t.shape)}, index {tuple(index.shape)}: need y [N, H] and "
                         "W_d [Vd, H] of one dtype, t [M, Ht], W_t [Vd, Ht], index [N]")
    if chunk_size < 1:
        raise ValueError(f"head_loss: chunk_size={chunk_size}; use a positive row count")
    grad_into = fp32_grad(w_d) if grad_into is None else grad_into
    return _HeadLoss.apply(y, w_d.detach(), grad_into, t.detach(), w_t.detach(), index, loss_sum, chunk_size)
