"""The soft cross-entropy of SPEC.md section 4, split where the TTT steps share work.

Per row: teacher logits a = t W_t^T, p = softmax(a) over the Vd draft ids, drafter logits b = y W_d^T,
    loss_row = -sum_v p_v log_softmax(b)_v = logsumexp(b) - sum_v p_v b_v = logsumexp(b) - y . q,
with q = p W_d = sum_v p_v W_d[v], the teacher's expected draft-head row ([H]; differentiable in W_d).
q depends on the teacher row only, and TTT step k scores row t against teacher row t+1+k: the K steps
read the same teacher rows, so q is computed once per batch (``teacher_expectation``) and each step pays
only for its own ``draft_logsumexp`` (the logsumexp and argmax of y W_d^T). Matmuls per batch: 4 for the
teacher plus 4 per step (forward 1; backward recompute, dy, dW), against 6 per step when every step
recomputes its teacher (42 -> 32 at K=7).

``draft_logsumexp`` has three implementations (all fp32 softmax):
- "triton":  streams vocab blocks with an online logsumexp; no [N, Vd] tensor is ever stored (it keeps
             one fp32 lse per row for backward). The backward recomputes each (row block, vocab block)
             tile and atomically adds its share of dy and dW_d.
- "chunked": torch over row chunks, recomputing chunks in backward (CPU fallback and the oracle).
- "naive":   torch autograd over the materialised [N, Vd] logits (tests and benchmark baseline).
``teacher_expectation`` runs torch over row chunks (two cuBLAS matmuls per chunk, [chunk, Vd] alive at
a time), recomputing p in backward. ``fused_draft_loss`` composes the two for one step (its "naive" impl
is the formula itself, materialised, as the oracle).
The torch paths take logits from F.linear in the input dtype (what a bf16 lm_head gives); the kernel keeps
fp32 logits, so with bf16 inputs the paths agree to bf16 logit rounding, with fp32 inputs to float error.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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
                    UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_DY: tl.constexpr, HAS_DW: tl.constexpr):
    # Program (row block, vocab block): recompute the logit tile, d = g * softmax(b) on it, then add
    # dy[rows] += d @ W_d[cols] and dW_d[cols] += d^T @ y[rows] into fp32 buffers, H-slice by H-slice.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64 offsets, as above
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    b = _logits_tile(y_ptr, wd_ptr, rows, cols, row_ok, col_ok, H, stride_y, stride_wd,
                     BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)  # upstream grad of lse, 0 on padded rows
    d = tl.where(col_ok[None, :], tl.exp(b - lse[:, None]) * g[:, None], 0.0)
    d_in = d.to(y_ptr.dtype.element_ty)
    if UPCAST:
        d_in = d
    for h0 in range(0, H, BLOCK_K):
        hs = h0 + tl.arange(0, BLOCK_K)
        h_ok = hs < H
        if HAS_DY:
            w = tl.load(wd_ptr + cols[:, None] * stride_wd + hs[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            part = tl.dot(d_in, w, input_precision=PREC)
            tl.atomic_add(dy_ptr + rows[:, None] * H + hs[None, :], part, mask=row_ok[:, None] & h_ok[None, :])
        if HAS_DW:
            x = tl.load(y_ptr + rows[:, None] * stride_y + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
            part = tl.dot(tl.trans(d_in), x, input_precision=PREC)
            tl.atomic_add(dwd_ptr + cols[:, None] * H + hs[None, :], part, mask=col_ok[:, None] & h_ok[None, :])


def _prec(x: torch.Tensor) -> str:
    # fp32 inputs get exact fp32 products (tests, oracle parity); bf16/fp16 use tensor cores anyway.
    return "ieee" if x.dtype == torch.float32 else "tf32"


class _TritonLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_d):
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
        ctx.save_for_backward(y, w_d, lse)
        ctx.mark_non_differentiable(argmax)
        return lse, argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, lse = ctx.saved_tensors
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dy or need_dw):
            return None, None
        n, h = y.shape
        v = w_d.shape[0]
        dy = torch.zeros(n, h, device=y.device, dtype=torch.float32) if need_dy else lse
        dw = torch.zeros(v, h, device=y.device, dtype=torch.float32) if need_dw else lse
        grid = (triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(v, TILES["BLOCK_V"]))
        _lse_bwd_kernel[grid](y, w_d, lse, grad.float().contiguous(), dy, dw, n, v, h, y.stride(0), w_d.stride(0),
                              UPCAST=INTERPRET, PREC=_prec(y), HAS_DY=need_dy, HAS_DW=need_dw, **TILES)
        return (dy.to(y.dtype) if need_dy else None), (dw.to(w_d.dtype) if need_dw else None)


class _ChunkedLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_d, chunk_size):
        lses, args = [], []
        for i in range(0, y.shape[0], chunk_size):
            b = F.linear(y[i:i + chunk_size], w_d).float()
            lses.append(torch.logsumexp(b, -1))
            args.append(b.argmax(-1))
        lse, argmax = torch.cat(lses), torch.cat(args)
        ctx.save_for_backward(y, w_d, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(argmax)
        return lse, argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, lse = ctx.saved_tensors
        dy = torch.empty_like(y) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for i in range(0, y.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            d = F.linear(y[s], w_d).float().sub_(lse[s, None]).exp_().mul_(grad[s, None]).to(y.dtype)
            if dy is not None:
                dy[s] = d @ w_d
            if dw is not None:
                dw.add_(d.t() @ y[s])  # input-dtype product, fp32 accumulation across chunks
        return dy, (dw.to(w_d.dtype) if dw is not None else None), None


class _TeacherExpectation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, w_t, w_d, chunk_size):
        chunk_size = max(1, min(chunk_size, TEACHER_CHUNK_ELEMENTS // w_t.shape[0]))
        q = torch.empty(t.shape[0], w_d.shape[1], device=t.device, dtype=torch.float32)
        for i in range(0, t.shape[0], chunk_size):
            p = torch.softmax(F.linear(t[i:i + chunk_size], w_t).float(), -1)
            q[i:i + chunk_size] = p.to(w_d.dtype) @ w_d
        ctx.save_for_backward(t, w_t, w_d)
        ctx.chunk_size = chunk_size
        return q

    @staticmethod
    def backward(ctx, grad_q):
        t, w_t, w_d = ctx.saved_tensors
        if not ctx.needs_input_grad[2]:
            return None, None, None, None
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32)
        for i in range(0, t.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            p = torch.softmax(F.linear(t[s], w_t).float(), -1)
            dw.add_(p.to(w_d.dtype).t() @ grad_q[s].to(w_d.dtype))
        return None, None, dw.to(w_d.dtype), None


class _GatherDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, q, index):
        ctx.save_for_backward(y, q, index)
        return (y.float() * q[index]).sum(-1)  # the gathered and upcast copies die here

    @staticmethod
    def backward(ctx, grad):
        y, q, index = ctx.saved_tensors
        dy = (grad[:, None] * q[index]).to(y.dtype) if ctx.needs_input_grad[0] else None
        dq = torch.zeros_like(q).index_add_(0, index, grad[:, None] * y.float()) if ctx.needs_input_grad[1] else None
        return dy, dq, None


def gather_dot(y: torch.Tensor, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``(y.float() * q[index]).sum(-1)`` [N] fp32, keeping only y, q and index for backward (plain autograd
    would keep an fp32 copy of y and of q[index] per call: per TTT step)."""
    return _GatherDot.apply(y, q, index)


def teacher_expectation(t: torch.Tensor, w_t: torch.Tensor, w_d: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """q = softmax(t W_t^T) W_d, ``[M, H]`` fp32: the teacher's expected drafter-head row per teacher row.

    t [M, Ht] target's final normed states, w_t [Vd, Ht] draft-vocab rows of the target's lm_head (both
    frozen), w_d [Vd, H] the drafter's lm_head (gets the gradient). ``chunk_size`` rows at a time, fewer
    when [chunk, Vd] would pass TEACHER_CHUNK_ELEMENTS.
    """
    if t.shape[1] != w_t.shape[1] or w_t.shape[0] != w_d.shape[0] or chunk_size < 1:
        raise ValueError(f"teacher_expectation: t {tuple(t.shape)}, W_t {tuple(w_t.shape)}, W_d {tuple(w_d.shape)}, "
                         f"chunk_size={chunk_size}: need t [M, Ht], W_t [Vd, Ht], W_d [Vd, H], chunk_size >= 1")
    return _TeacherExpectation.apply(t.detach(), w_t.detach(), w_d, chunk_size)


def draft_logsumexp(y: torch.Tensor, w_d: torch.Tensor, impl: str = "auto",
                    chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp over the draft vocab of y W_d^T [N] fp32, its argmax [N] int64), differentiable in y, W_d.

    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "chunked" (torch, chunk_size rows at a time),
    "naive" (torch, materialised), "auto" = triton on CUDA tensors, chunked elsewhere.
    """
    if impl not in IMPLS:
        raise ValueError(f"draft_logsumexp: impl={impl!r}; use one of {IMPLS}")
    if y.dim() != 2 or w_d.dim() != 2 or y.shape[1] != w_d.shape[1] or y.dtype != w_d.dtype:
        raise ValueError(f"draft_logsumexp: y {tuple(y.shape)} {y.dtype}, W_d {tuple(w_d.shape)} {w_d.dtype}: "
                         "need y [N, H] and W_d [Vd, H] of one dtype")
    if chunk_size < 1:
        raise ValueError(f"draft_logsumexp: chunk_size={chunk_size}; use a positive row count")
    if impl == "auto":
        impl = "triton" if y.is_cuda else "chunked"
    if impl == "triton":
        if not (y.is_cuda or INTERPRET):
            raise ValueError("draft_logsumexp: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        return _TritonLSE.apply(y, w_d)
    if impl == "chunked":
        return _ChunkedLSE.apply(y, w_d, chunk_size)
    b = F.linear(y, w_d).float()
    return torch.logsumexp(b, -1), b.argmax(-1)


def fused_draft_loss(y: torch.Tensor, w_d: torch.Tensor, t: torch.Tensor, w_t: torch.Tensor,
                     m: torch.Tensor, impl: str = "auto", chunk_size: int = 1024,
                     reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the drafter against the teacher over the draft vocab, for one TTT step.

    y [N, H] drafter's final normed state, w_d [Vd, H] drafter lm_head (trainable), t [N, Ht] target's
    final normed state aligned with y, w_t [Vd, Ht] draft-vocab rows of the target's lm_head (frozen), m [N]
    row weight (0 masks a row). Returns (loss, draft_argmax [N] int64) where loss is sum_rows m * loss_row
    (scalar fp32) for reduction="sum", or m * loss_row [N] for "none". Differentiable in y and w_d. impl as
    for ``draft_logsumexp``; "naive" materialises the formula itself (the oracle). For K steps sharing
    teacher rows, call ``teacher_expectation`` once and ``draft_logsumexp`` per step (train/loss.py).
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
        lse, argmax = draft_logsumexp(y, w_d, impl, chunk_size)
        q = teacher_expectation(t, w_t, w_d, chunk_size)
        loss_row = lse - gather_dot(y, q, torch.arange(n, device=y.device))
    weighted = loss_row * m.detach().float()
    return (weighted.sum() if reduction == "sum" else weighted), argmax
