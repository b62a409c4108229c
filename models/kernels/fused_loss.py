"""Draft-head + teacher + soft cross-entropy in one pass over the draft vocab (SPEC.md section 4).

Per row: teacher logits a = t W_t^T, p = softmax(a) over the Vd draft ids, drafter logits b = y W_d^T,
loss_row = -sum_v p_v log_softmax(b)_v = logsumexp(b) - sum_v p_v b_v, and dL/db = m * (softmax(b) - p).

Three implementations of the same function (all fp32 softmax and loss):
- "triton":  streams vocab blocks with an online softmax (running max/sum for a and b, plus the running
             sum of exp(a) * b for the cross term); no [N, Vd] tensor is ever stored. The backward
             recomputes each (row block, vocab block) tile and atomically adds its share of dy and dW_d.
- "chunked": torch, over row chunks, recomputing chunks in backward (CPU fallback and the oracle).
- "naive":   torch autograd over the materialised [N, Vd] logits (tests and benchmark baseline).
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
    FWD = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1)
    BWD = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1)
else:
    FWD = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
    BWD = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)

IMPLS = ("auto", "triton", "chunked", "naive")


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
def _fwd_kernel(y_ptr, wd_ptr, t_ptr, wt_ptr, stats_ptr, arg_ptr,
                N, V, H, HT, stride_y, stride_wd, stride_t, stride_wt, blocks_per_split,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr, PREC: tl.constexpr):
    # Program (row block, vocab split). Writes 6 running stats per row for its split:
    # stats[split, :, row] = (max_b, sum exp(b - max_b), max_a, sum exp(a - max_a),
    #                         sum exp(a - max_a) * b, best b); the torch side merges splits.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: rows * stride may pass 2**31
    row_ok = rows < N
    m_b = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_b = tl.zeros((BLOCK_N,), tl.float32)
    m_a = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_a = tl.zeros((BLOCK_N,), tl.float32)
    cross = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)
    v_start = split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(v_start + blocks_per_split * BLOCK_V, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        b = _logits_tile(y_ptr, wd_ptr, rows, cols, row_ok, col_ok, H, stride_y, stride_wd,
                         BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
        a = _logits_tile(t_ptr, wt_ptr, rows, cols, row_ok, col_ok, HT, stride_t, stride_wt,
                         BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
        b_inf = tl.where(col_ok[None, :], b, float("-inf"))
        a_inf = tl.where(col_ok[None, :], a, float("-inf"))
        blk_max_b = tl.max(b_inf, axis=1)
        blk_arg = tl.argmax(b_inf, axis=1).to(tl.int32) + v0
        take = blk_max_b > best  # strict: earlier blocks win ties, like torch.argmax
        best_idx = tl.where(take, blk_arg, best_idx)
        best = tl.where(take, blk_max_b, best)
        new_m_b = tl.maximum(m_b, blk_max_b)
        s_b = s_b * tl.exp(m_b - new_m_b) + tl.sum(tl.exp(b_inf - new_m_b[:, None]), axis=1)
        m_b = new_m_b
        new_m_a = tl.maximum(m_a, tl.max(a_inf, axis=1))
        alpha = tl.exp(m_a - new_m_a)
        e_a = tl.exp(a_inf - new_m_a[:, None])  # 0 on padded columns
        s_a = s_a * alpha + tl.sum(e_a, axis=1)
        cross = cross * alpha + tl.sum(e_a * tl.where(col_ok[None, :], b, 0.0), axis=1)
        m_a = new_m_a
    base = stats_ptr + split * 6 * N + rows
    tl.store(base, m_b, mask=row_ok)
    tl.store(base + N, s_b, mask=row_ok)
    tl.store(base + 2 * N, m_a, mask=row_ok)
    tl.store(base + 3 * N, s_a, mask=row_ok)
    tl.store(base + 4 * N, cross, mask=row_ok)
    tl.store(base + 5 * N, best, mask=row_ok)
    tl.store(arg_ptr + split * N + rows, best_idx, mask=row_ok)


@triton.jit
def _bwd_kernel(y_ptr, wd_ptr, t_ptr, wt_ptr, lse_b_ptr, lse_a_ptr, r_ptr, dy_ptr, dwd_ptr,
                N, V, H, HT, stride_y, stride_wd, stride_t, stride_wt,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_DY: tl.constexpr, HAS_DW: tl.constexpr):
    # Program (row block, vocab block): recompute both logit tiles, form dL/db for the tile, then add
    # dy[rows] += dB @ W_d[cols] and dW_d[cols] += dB^T @ y[rows] into fp32 buffers, H-slice by H-slice.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64 offsets, as above
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    b = _logits_tile(y_ptr, wd_ptr, rows, cols, row_ok, col_ok, H, stride_y, stride_wd,
                     BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
    a = _logits_tile(t_ptr, wt_ptr, rows, cols, row_ok, col_ok, HT, stride_t, stride_wt,
                     BLOCK_N, BLOCK_V, BLOCK_K, UPCAST, PREC)
    lse_b = tl.load(lse_b_ptr + rows, mask=row_ok, other=0.0)
    lse_a = tl.load(lse_a_ptr + rows, mask=row_ok, other=0.0)
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0)  # mask * upstream grad, 0 on padded rows
    d = (tl.exp(b - lse_b[:, None]) - tl.exp(a - lse_a[:, None])) * r[:, None]
    d = tl.where(col_ok[None, :], d, 0.0)
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


def _triton_forward(y, w_d, t, w_t):
    """-> (loss_row [N] f32, lse_b [N] f32, lse_a [N] f32, argmax [N] int64)."""
    n, h = y.shape
    v, ht = w_d.shape[0], t.shape[1]
    cfg = FWD
    row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    vocab_blocks = triton.cdiv(v, cfg["BLOCK_V"])
    # Split the vocab across programs when there are too few row blocks to fill the device.
    want = 2 if INTERPRET else 4 * torch.cuda.get_device_properties(y.device).multi_processor_count
    splits = max(1, min(vocab_blocks, want // max(row_blocks, 1)))
    per_split = triton.cdiv(vocab_blocks, splits)
    splits = triton.cdiv(vocab_blocks, per_split)
    stats = torch.empty(splits, 6, n, device=y.device, dtype=torch.float32)
    args = torch.empty(splits, n, device=y.device, dtype=torch.int32)
    _fwd_kernel[(row_blocks, splits)](
        y, w_d, t, w_t, stats, args, n, v, h, ht,
        y.stride(0), w_d.stride(0), t.stride(0), w_t.stride(0), per_split,
        UPCAST=INTERPRET, PREC=_prec(y), **cfg)
    m_b, s_b, m_a, s_a, cross, best = stats.unbind(1)
    top_b = m_b.amax(0)
    lse_b = top_b + torch.log((s_b * torch.exp(m_b - top_b)).sum(0))
    top_a = m_a.amax(0)
    scale_a = torch.exp(m_a - top_a)
    z_a = (s_a * scale_a).sum(0)
    lse_a = top_a + torch.log(z_a)
    loss_row = lse_b - (cross * scale_a).sum(0) / z_a
    argmax = args.gather(0, best.argmax(0, keepdim=True)).squeeze(0).long()
    return loss_row, lse_b, lse_a, argmax


def _triton_backward(y, w_d, t, w_t, lse_b, lse_a, r, need_dy, need_dw):
    n, h = y.shape
    v, ht = w_d.shape[0], t.shape[1]
    cfg = BWD
    dy = torch.zeros(n, h, device=y.device, dtype=torch.float32) if need_dy else lse_b
    dw = torch.zeros(v, h, device=y.device, dtype=torch.float32) if need_dw else lse_b
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(v, cfg["BLOCK_V"]))
    _bwd_kernel[grid](
        y, w_d, t, w_t, lse_b, lse_a, r, dy, dw, n, v, h, ht,
        y.stride(0), w_d.stride(0), t.stride(0), w_t.stride(0),
        UPCAST=INTERPRET, PREC=_prec(y), HAS_DY=need_dy, HAS_DW=need_dw, **cfg)
    return (dy.to(y.dtype) if need_dy else None), (dw.to(w_d.dtype) if need_dw else None)


def _row_scale(m, grad, reduction):
    """Per-row dL/d(loss_row): the mask times the upstream gradient (a scalar for "sum")."""
    return (m.float() * (grad if reduction == "none" else grad.reshape(()))).float().contiguous()


def _reduce(loss_row, m, reduction):
    weighted = loss_row * m.float()
    return weighted.sum() if reduction == "sum" else weighted


class _TritonLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_d, t, w_t, m, reduction):
        y, w_d, t, w_t = (x.contiguous() for x in (y, w_d, t, w_t))
        loss_row, lse_b, lse_a, argmax = _triton_forward(y, w_d, t, w_t)
        ctx.save_for_backward(y, w_d, t, w_t, m, lse_b, lse_a)
        ctx.reduction = reduction
        ctx.mark_non_differentiable(argmax)
        return _reduce(loss_row, m, reduction), argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, t, w_t, m, lse_b, lse_a = ctx.saved_tensors
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dy or need_dw):
            return None, None, None, None, None, None
        r = _row_scale(m, grad, ctx.reduction)
        dy, dw = _triton_backward(y, w_d, t, w_t, lse_b, lse_a, r, need_dy, need_dw)
        return dy, dw, None, None, None, None


def _chunk_stats(y, w_d, t, w_t):
    """Materialise one row chunk: -> (loss_row, log_softmax(b), p, argmax); fp32, [rows, Vd] for the middle two."""
    b = F.linear(y, w_d).float()
    a = F.linear(t, w_t).float()
    log_q = torch.log_softmax(b, dim=-1)
    p = torch.softmax(a, dim=-1)
    loss_row = -(p * log_q).sum(-1)
    return loss_row, log_q, p, b.argmax(-1)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_d, t, w_t, m, reduction, chunk_size):
        losses, args = [], []
        for i in range(0, y.shape[0], chunk_size):
            s = slice(i, i + chunk_size)
            loss_row, _, _, arg = _chunk_stats(y[s], w_d, t[s], w_t)
            losses.append(loss_row)
            args.append(arg)
        ctx.save_for_backward(y, w_d, t, w_t, m)
        ctx.reduction, ctx.chunk_size = reduction, chunk_size
        argmax = torch.cat(args)
        ctx.mark_non_differentiable(argmax)
        return _reduce(torch.cat(losses), m, reduction), argmax

    @staticmethod
    def backward(ctx, grad, _grad_argmax):
        y, w_d, t, w_t, m = ctx.saved_tensors
        r = _row_scale(m, grad, ctx.reduction)
        dy = torch.empty_like(y) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w_d.shape, device=w_d.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        if dy is None and dw is None:
            return (None,) * 7
        for i in range(0, y.shape[0], ctx.chunk_size):
            s = slice(i, i + ctx.chunk_size)
            _, log_q, p, _ = _chunk_stats(y[s], w_d, t[s], w_t)
            d_b = log_q.exp_().sub_(p).mul_(r[s, None]).to(y.dtype)  # dL/db = r * (softmax(b) - p)
            if dy is not None:
                dy[s] = d_b @ w_d
            if dw is not None:
                dw.add_(d_b.t() @ y[s])  # input-dtype product, fp32 accumulation across chunks
        return dy, (dw.to(w_d.dtype) if dw is not None else None), None, None, None, None, None


def _naive(y, w_d, t, w_t, m, reduction):
    loss_row, _, _, argmax = _chunk_stats(y, w_d, t, w_t)
    return _reduce(loss_row, m, reduction), argmax


def _check(y, w_d, t, w_t, m, reduction, impl, chunk_size):
    if impl not in IMPLS:
        raise ValueError(f"fused_draft_loss: impl={impl!r}; use one of {IMPLS}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"fused_draft_loss: reduction={reduction!r}; use 'sum' or 'none'")
    if chunk_size < 1:
        raise ValueError(f"fused_draft_loss: chunk_size={chunk_size}; use a positive row count")
    n, h = y.shape
    if w_d.shape[1] != h or t.shape[0] != n or w_t.shape[1] != t.shape[1] or w_t.shape[0] != w_d.shape[0] \
            or m.shape != (n,):
        raise ValueError(
            "fused_draft_loss: shapes must be y [N, H], W_d [Vd, H], t [N, Ht], W_t [Vd, Ht], m [N]; got "
            f"y {tuple(y.shape)}, W_d {tuple(w_d.shape)}, t {tuple(t.shape)}, W_t {tuple(w_t.shape)}, "
            f"m {tuple(m.shape)}")
    if y.dtype != w_d.dtype or t.dtype != w_t.dtype:
        raise ValueError(f"fused_draft_loss: y/W_d dtypes {y.dtype}/{w_d.dtype} and t/W_t dtypes {t.dtype}/{w_t.dtype} "
                         "must match pairwise; cast the states to their lm_head's dtype")


def fused_draft_loss(y: torch.Tensor, w_d: torch.Tensor, t: torch.Tensor, w_t: torch.Tensor,
                     m: torch.Tensor, impl: str = "auto", chunk_size: int = 1024,
                     reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of the drafter against the teacher over the draft vocab, for one TTT step.

    y [N, H] drafter's final normed state, w_d [Vd, H] drafter lm_head (trainable), t [N, Ht] target's
    final normed state, w_t [Vd, Ht] draft-vocab rows of the target's lm_head (frozen), m [N] row weight
    (0 masks a row). Returns (loss, draft_argmax [N] int64) where loss is sum_rows m * loss_row (scalar
    fp32) for reduction="sum", or m * loss_row [N] for "none". Differentiable in y and w_d (t and w_t
    get no gradient). impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "chunked" (torch, chunk_size
    rows at a time), "naive" (torch, materialised), "auto" = triton on CUDA tensors, chunked elsewhere.
    """
    _check(y, w_d, t, w_t, m, reduction, impl, chunk_size)
    if impl == "auto":
        impl = "triton" if y.is_cuda else "chunked"
    if impl == "triton":
        return _TritonLoss.apply(y, w_d, t.detach(), w_t.detach(), m.detach(), reduction)
    if impl == "chunked":
        return _ChunkedLoss.apply(y, w_d, t.detach(), w_t.detach(), m.detach(), reduction, chunk_size)
    return _naive(y, w_d, t.detach(), w_t.detach(), m.detach(), reduction)
