"""The TTT soft cross-entropy (docs/architecture.md, Training-time test), split where the TTT steps share work.

Per row: teacher logits a = t W_t^T, p = softmax(a) over the Vd draft ids, drafter logits b = y W_d^T,
    loss_row = -sum_v p_v log_softmax(b)_v = logsumexp(b) - sum_v p_v b_v = logsumexp(b) - y . q,
with q = p W_d = sum_v p_v W_d[v], the teacher's expected draft-head row ([H]; differentiable in W_d).
q depends on the teacher row only, and TTT step k scores row t against teacher row t+1+k: the K steps
read the same teacher rows, so q is computed once per batch (``teacher_expectation``) and each step pays
only for its own ``draft_cross_entropy`` (logsumexp and argmax of y W_d^T, minus y . q): the teacher's
logits and their backward are not recomputed by every step.

Each step's drafter part is ``draft_cross_entropy`` (logsumexp(b) - y . q per row, with its argmax); it
has three implementations (all fp32 logits and softmax):
- "triton":  streams vocab blocks with an online logsumexp; no [N, Vd] tensor is ever stored (it keeps
             one fp32 lse per row for backward). The backward recomputes each (row block, vocab block)
             tile and atomically adds its share of dy and dW_d into fp32 buffers.
- "chunked": torch over row chunks, recomputing chunks in backward (CPU fallback and the oracle).
- "naive":   torch autograd over the materialised [N, Vd] logits (tests and benchmark baseline).
``teacher_expectation`` runs torch over row chunks ([chunk, Vd] alive at a time), recomputing p in
backward. ``fused_draft_loss`` composes the two for one step (its "naive" impl is the formula itself,
materialised, as the oracle).

Precision. Near convergence the gradient dy = (softmax(b) - p) W_d is a small difference of two large
terms, and so is dW_d = sum_rows (softmax(b) - p)^T y (the second term reaching W_d through q). Every
quantity entering that difference stays fp32 until the difference is formed (fp32_accum.py): logits come
from GEMMs with an fp32 output, the softmax weights enter the backward GEMMs as hi + lo bf16 parts, dy is
formed in one fp32 buffer from both terms, and the K steps' and the teacher's dW_d terms sum in fp32 through
``grad_into`` (one ``fp32_grad`` stand-in per lm_head) before the one rounding to the parameter's dtype.
Rounding these to bf16 first cost the shared-teacher path 25% (dy) and 33% (dW) relative gradient error at
drafter-teacher KL 0.004 (tests/unit/train/test_loss.py::test_bf16_gradients_stay_accurate_near_convergence),
against 0.17% now, the error of fp32 math rounded once. The price on GPU: the kernel's backward runs five
tile GEMMs instead of three, the teacher seven GEMMs per batch instead of four.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fledge.models.kernels.fp32_accum import addmm_f32_, fp32_grad, mm_f32

# Must match how the kernels were decorated: TRITON_INTERPRET is read once, at import.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tile sizes. The interpreter runs numpy per program, so it gets the smallest legal tl.dot tiles.
if INTERPRET:
    TILES = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1)
else:
    TILES = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)

IMPLS = ("auto", "triton", "chunked", "naive")
# teacher_expectation's row chunks hold at most this many [rows, Vd] fp32 elements (32 MiB), so its
# transient memory does not grow with Vd (at Vd = 32000 a chunk is 262 rows, still a large GEMM).
TEACHER_CHUNK_ELEMENTS = 2**23


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_x, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_V] tile of x @ w^T, accumulated over K in BLOCK_K slices."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong: do the product in fp32 there
            x = x.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(x, wt, acc, input_precision=PREC)
    return acc


@triton.jit
def _lse_fwd_kernel(y_ptr, wd_ptr, stats_ptr, arg_ptr, N, V, H, stride_y, stride_wd, blocks_per_split,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PREC: tl.constexpr):
    # Program (row block, vocab split) writes stats[split, :, row] = (max b, sum exp(b - max b), best b)
    # and arg[split, row] over its split's vocab blocks; the torch side merges the splits.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: rows * stride may pass 2**31
    row_ok = rows < N
    m_b = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_b = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)
    v_start = split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(v_start + blocks_per_split * BLOCK_V, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        b = _logits_tile(y_ptr, wd_ptr, rows, cols, row_ok, col_ok, H, stride_y, stride_wd,
                         BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
        b = tl.where(col_ok[None, :], b, float("-inf"))
        blk_max = tl.max(b, axis=1)
        blk_arg = tl.argmax(b, axis=1).to(tl.int32) + v0
        take = blk_max > best  # strict: earlier blocks win ties, like torch.argmax
        best_idx = tl.where(take, blk_arg, best_idx)
        best = tl.where(take, blk_max, best)
        new_m = tl.maximum(m_b, blk_max)
        s_b = s_b * tl.exp(m_b - new_m) + tl.sum(tl.exp(b - new_m[:, None]), axis=1)
        m_b = new_m
    base = stats_ptr + split * 3 * N + rows
    tl.store(base, m_b, mask=row_ok)
    tl.store(base + N, s_b, mask=row_ok)
    tl.store(base + 2 * N, best, mask=row_ok)
    tl.store(arg_ptr + split * N + rows, best_idx, mask=row_ok)


@triton.jit
def _lse_bwd_kernel(y_ptr, wd_ptr, lse_ptr, g_ptr, dy_ptr, dwd_ptr, N, V, H, stride_y, stride_wd,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_DY: tl.constexpr, HAS_DW: tl.constexpr):
    # Program (row block, vocab block): recompute the logit tile, d = g * softmax(b) on it, then add
    # dy[rows] += d @ W_d[cols] and dW_d[cols] += d^T @ y[rows] into fp32 buffers, H-slice by H-slice.
    # SPLIT (bf16/fp16 inputs): d enters each product as hi + lo parts in the input dtype, so it carries ~16
    # bits: d is one of the two near-equal terms whose difference is the gradient, and rounding it to bf16
    # alone costs as much as rounding the gradient's terms (see the module docstring).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64 offsets, as above
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    b = _logits_tile(y_ptr, wd_ptr, rows, cols, row_ok, col_ok, H, stride_y, stride_wd,
                     BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)  # upstream grad of lse, 0 on padded rows
    d = tl.where(col_ok[None, :], tl.exp(b - lse[:, None]) * g[:, None], 0.0)
    d_hi = d
    d_lo = d
    if SPLIT:
        d_hi = d.to(y_ptr.dtype.element_ty)
        d_lo = (d - d_hi.to(tl.float32)).to(y_ptr.dtype.element_ty)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong: the parts multiply in fp32 there
            d_hi = d_hi.to(tl.float32)
            d_lo = d_lo.to(tl.float32)
    for h0 in range(0, H, BLOCK_K):
        hs = h0 + tl.arange(0, BLOCK_K)
        h_ok = hs < H
        if HAS_DY:
            w = tl.load(wd_ptr + cols[:, None] * stride_wd + hs[None, :], mask=col_ok[:, None] & h_ok[None, :],
                        other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            part = tl.dot(d_hi, w, input_precision=PREC)
            if SPLIT:
                part = tl.dot(d_lo, w, part, input_precision=PREC)
            tl.atomic_add(dy_ptr + rows[:, None] * H + hs[None, :], part, mask=row_ok[:, None] & h_ok[None, :])
        if HAS_DW:
            x = tl.load(y_ptr + rows[:, None] * stride_y + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
            part = tl.dot(tl.trans(d_hi), x, input_precision=PREC)
            if SPLIT:
                part = tl.dot(tl.trans(d_lo), x, part, input_precision=PREC)
            tl.atomic_add(dwd_ptr + cols[:, None] * H + hs[None, :], part, mask=col_ok[:, None] & h_ok[None, :])


def _prec(x: torch.Tensor) -> str:
    # fp32 inputs get exact fp32 products (tests, oracle parity); bf16/fp16 use tensor cores anyway.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _teacher_dot(y, q, index):
    """y . q[index] per row, fp32 [N] (the gathered and upcast copies die here)."""
    return (y.float() * q[index]).sum(-1)


def _teacher_dot_grads(g, y, q, index, need_dy, need_dq):
    """The y . q[index] term's share of backward: dy's fp32 start value -g q[index] (the softmax term is then
    added to it in fp32) and dq (fp32, summed over the rows sharing a teacher row). None where not needed."""
    if q is None:
        return (torch.zeros(y.shape, device=y.device, dtype=torch.float32) if need_dy else None), None
    dy0 = q.index_select(0, index).mul_(-g[:, None]) if need_dy else None
    dq = torch.zeros_like(q).index_add_(0, index, -g[:, None] * y.float()) if need_dq else None
    return dy0, dq


class _TritonCE(torch.autograd.Function):
    """(lse - y . q[index], argmax) with the Triton kernel; W_d's gradient goes to ``w_grad`` (fp32)."""

    @staticmethod
    def forward(ctx, y, w_d, w_grad, q, index):
        y, w_d = y.contiguous(), w_d.contiguous()
        n, h = y.shape
        v = w_d.shape[0]
        row_blocks, vocab_blocks = triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(v, TILES["BLOCK_V"])
        # Split the vocab across programs when there are too few row blocks to fill the device.
        want = 2 if INTERPRET else 4 * torch.cuda.get_device_properties(y.device).multi_processor_count
        per_split = triton.cdiv(vocab_blocks, max(1, min(vocab_blocks, want // max(row_blocks, 1))))
        splits = triton.cdiv(vocab_blocks, per_split)
        stats = torch.empty(splits, 3, n, device=y.device, dtype=torch.float32)
        args = torch.empty(splits, n, device=y.device, dtype=torch.int32)
        _lse_fwd_kernel[(row_blocks, splits)](y, w_d, stats, args, n, v, h, y.stride(0), w_d.stride(0), per_split,
                                              UPCAST=INTERPRET, PREC=_prec(y), **TILES)
        m_b, s_b, best = stats.unbind(1)
        top = m_b.amax(0)
        lse = top + torch.log((s_b * torch.exp(m_b - top)).sum(0))
        argmax = args.gather(0, best.argmax(0, keepdim=True)).squeeze(0).long()
        ctx.save_for_backward(y, w_d, lse, q, index)
        ctx.mark_non_differentiable(argmax)
        return (lse if q is None else lse - _teacher_dot(y, q, index)), argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, lse, q, index = ctx.saved_tensors
        need_dy, need_dw, need_dq = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        n, h = y.shape
        v = w_d.shape[0]
        g = grad.float().contiguous()
        dy, dq = _teacher_dot_grads(g, y, q, index, need_dy, need_dq)
        dw = torch.zeros(v, h, device=y.device, dtype=torch.float32) if need_dw else None
        if need_dy or need_dw:
            grid = (triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(v, TILES["BLOCK_V"]))
            _lse_bwd_kernel[grid](y, w_d, lse, g, dy if need_dy else lse, dw if need_dw else lse, n, v, h,
                                  y.stride(0), w_d.stride(0), UPCAST=INTERPRET, PREC=_prec(y),
                                  SPLIT=y.dtype != torch.float32, HAS_DY=need_dy, HAS_DW=need_dw, **TILES)
        # dy holds both terms in fp32: rounded once, here.
        return (dy.to(y.dtype) if need_dy else None), None, dw, dq, None


class _ChunkedCE(torch.autograd.Function):
    """(lse - y . q[index], argmax) in torch, chunk_size rows at a time; W_d's gradient goes to ``w_grad``."""

    @staticmethod
    def forward(ctx, y, w_d, w_grad, q, index, chunk_size):
        lses, args = [], []
        for i in range(0, y.shape[0], chunk_size):
            b = mm_f32(y[i:i + chunk_size], w_d.t(), w_d.dtype)
            lses.append(torch.logsumexp(b, -1))
            args.append(b.argmax(-1))
        lse, argmax = torch.cat(lses), torch.cat(args)
        ctx.save_for_backward(y, w_d, lse, q, index)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(argmax)
        return (lse if q is None else lse - _teacher_dot(y, q, index)), argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, lse, q, index = ctx.saved_tensors
        need_dy, need_dw, need_dq = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        g = grad.float()
        dy, dq = _teacher_dot_grads(g, y, q, index, need_dy, need_dq)
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32) if need_dw else None
        for i in range(0, y.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            d = mm_f32(y[s], w_d.t(), w_d.dtype).sub_(lse[s, None]).exp_().mul_(g[s, None])
            if need_dy:
                addmm_f32_(dy[s], d, w_d, w_d.dtype)
            if need_dw:
                addmm_f32_(dw, d.t(), y[s], w_d.dtype)
        return (dy.to(y.dtype) if need_dy else None), None, dw, dq, None, None


class _TeacherExpectation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, w_t, w_d, w_grad, chunk_size):
        chunk_size = max(1, min(chunk_size, TEACHER_CHUNK_ELEMENTS // w_t.shape[0]))
        q = torch.empty(t.shape[0], w_d.shape[1], device=t.device, dtype=torch.float32)
        for i in range(0, t.shape[0], chunk_size):
            p = torch.softmax(mm_f32(t[i:i + chunk_size], w_t.t(), w_t.dtype), -1)
            q[i:i + chunk_size] = mm_f32(p, w_d, w_d.dtype)
        ctx.save_for_backward(t, w_t, w_d)
        ctx.chunk_size = chunk_size
        return q

    @staticmethod
    def backward(ctx, grad_q):
        t, w_t, w_d = ctx.saved_tensors
        if not ctx.needs_input_grad[3]:
            return None, None, None, None, None
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32)
        for i in range(0, t.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            p = torch.softmax(mm_f32(t[s], w_t.t(), w_t.dtype), -1)
            addmm_f32_(dw, p.t(), grad_q[s].float(), w_d.dtype)
        return None, None, None, dw, None


def teacher_expectation(t: torch.Tensor, w_t: torch.Tensor, w_d: torch.Tensor, chunk_size: int = 1024,
                        grad_into: torch.Tensor | None = None) -> torch.Tensor:
    """q = softmax(t W_t^T) W_d, ``[M, H]`` fp32: the teacher's expected drafter-head row per teacher row.

    t [M, Ht] target's final normed states, w_t [Vd, Ht] draft-vocab rows of the target's lm_head (both
    frozen), w_d [Vd, H] the drafter's lm_head (gets the gradient). ``chunk_size`` rows at a time, fewer
    when [chunk, Vd] would pass TEACHER_CHUNK_ELEMENTS. ``grad_into``: the ``fp32_grad(w_d)`` stand-in that
    sums W_d's gradient terms in fp32 (shared with the ``draft_cross_entropy`` calls using this q); None =
    a stand-in of its own.
    """
    if t.shape[1] != w_t.shape[1] or w_t.shape[0] != w_d.shape[0] or chunk_size < 1:
        raise ValueError(f"teacher_expectation: t {tuple(t.shape)}, W_t {tuple(w_t.shape)}, W_d {tuple(w_d.shape)}, "
                         f"chunk_size={chunk_size}: need t [M, Ht], W_t [Vd, Ht], W_d [Vd, H], chunk_size >= 1")
    grad_into = fp32_grad(w_d) if grad_into is None else grad_into
    return _TeacherExpectation.apply(t.detach(), w_t.detach(), w_d.detach(), grad_into, chunk_size)


def draft_cross_entropy(y: torch.Tensor, w_d: torch.Tensor, q: torch.Tensor | None, index: torch.Tensor | None,
                        impl: str = "auto", chunk_size: int = 1024,
                        grad_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp over the draft vocab of y W_d^T minus y . q[index], [N] fp32; the argmax of y W_d^T, [N] int64).

    With q from ``teacher_expectation`` this is the soft CE per row against teacher row ``index``; q=None
    gives the logsumexp alone. Differentiable in y, W_d and q; dy's two terms are formed in fp32 and rounded
    once. impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "chunked" (torch, chunk_size rows at a time),
    "naive" (torch autograd, materialised), "auto" = triton on CUDA tensors, chunked elsewhere. ``grad_into``
    as for ``teacher_expectation`` (the naive impl ignores it: plain autograd).
    """
    if impl not in IMPLS:
        raise ValueError(f"draft_cross_entropy: impl={impl!r}; use one of {IMPLS}")
    if y.dim() != 2 or w_d.dim() != 2 or y.shape[1] != w_d.shape[1] or y.dtype != w_d.dtype:
        raise ValueError(f"draft_cross_entropy: y {tuple(y.shape)} {y.dtype}, W_d {tuple(w_d.shape)} {w_d.dtype}: "
                         "need y [N, H] and W_d [Vd, H] of one dtype")
    if chunk_size < 1:
        raise ValueError(f"draft_cross_entropy: chunk_size={chunk_size}; use a positive row count")
    if (q is None) != (index is None):
        raise ValueError("draft_cross_entropy: pass q and index together (or neither)")
    if impl == "auto":
        impl = "triton" if y.is_cuda else "chunked"
    if impl == "naive":
        b = F.linear(y, w_d).float()
        lse = torch.logsumexp(b, -1)
        return (lse if q is None else lse - _teacher_dot(y, q, index)), b.argmax(-1)
    grad_into = fp32_grad(w_d) if grad_into is None else grad_into
    if impl == "triton":
        if not (y.is_cuda or INTERPRET):
            raise ValueError("draft_cross_entropy: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        return _TritonCE.apply(y, w_d.detach(), grad_into, q, index)
    return _ChunkedCE.apply(y, w_d.detach(), grad_into, q, index, chunk_size)


def draft_logsumexp(y: torch.Tensor, w_d: torch.Tensor, impl: str = "auto", chunk_size: int = 1024,
                    grad_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp over the draft vocab of y W_d^T [N] fp32, its argmax [N] int64), differentiable in y, W_d:
    ``draft_cross_entropy`` without the teacher term."""
    return draft_cross_entropy(y, w_d, None, None, impl, chunk_size, grad_into)


def fused_draft_loss(y: torch.Tensor, w_d: torch.Tensor, t: torch.Tensor, w_t: torch.Tensor,
                     m: torch.Tensor, impl: str = "auto", chunk_size: int = 1024,
                     reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the drafter against the teacher over the draft vocab, for one TTT step.

    y [N, H] drafter's final normed state, w_d [Vd, H] drafter lm_head (trainable), t [N, Ht] target's
    final normed state aligned with y, w_t [Vd, Ht] draft-vocab rows of the target's lm_head (frozen), m [N]
    row weight (0 masks a row). Returns (loss, draft_argmax [N] int64) where loss is sum_rows m * loss_row
    (scalar fp32) for reduction="sum", or m * loss_row [N] for "none". Differentiable in y and w_d. impl as
    for ``draft_cross_entropy``; "naive" materialises the formula itself (the oracle). For K steps sharing
    teacher rows, call ``teacher_expectation`` once and ``draft_cross_entropy`` per step (train/losses).
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"fused_draft_loss: reduction={reduction!r}; use 'sum' or 'none'")
    n = y.shape[0]
    if t.shape[0] != n or m.shape != (n,) or t.dtype != w_t.dtype:
        raise ValueError(f"fused_draft_loss: y {tuple(y.shape)}, t {tuple(t.shape)} {t.dtype}, W_t {w_t.dtype}, "
                         f"m {tuple(m.shape)}: need N rows in y, t and m, and t in W_t's dtype")
    if impl == "naive":
        b = F.linear(y, w_d).float()
        p = torch.softmax(F.linear(t.detach(), w_t.detach()).float(), -1)
        loss_row, argmax = -(p * torch.log_softmax(b, -1)).sum(-1), b.argmax(-1)
    else:
        w_grad = fp32_grad(w_d)  # the logsumexp's and the teacher's dW_d terms sum in fp32
        q = teacher_expectation(t, w_t, w_d, chunk_size, grad_into=w_grad)
        loss_row, argmax = draft_cross_entropy(y, w_d, q, torch.arange(n, device=y.device), impl, chunk_size,
                                               grad_into=w_grad)
    weighted = loss_row * m.detach().float()
    return (weighted.sum() if reduction == "sum" else weighted), argmax
