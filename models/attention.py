"""Training-time-test attention (SPEC.md section 4) and the engine's cached attention.

At TTT step k, row t attends to the step-0 keys 0..t of its own document plus, for every step
j = 1..k, only the key that step produced at row t. With keys concatenated over steps the mask is
``[causal & same-doc | I | I | ...]``. Three implementations of that one function:

- ``dense``: the concatenated keys with a dense boolean mask through SDPA. O(T * (k+1) T) memory;
  the reference the tests compare against.
- ``sdpa``: the memory-linear CPU path. A custom autograd function that walks query blocks; per block
  it scores the step-0 keys that can be causal (``[bq, <= T]``) and the k diagonal keys as row-wise dot
  products, and takes one joint softmax over both. Only q, k, v, the output and the log-sum-exp are
  saved; the backward recomputes each block's probabilities (FlashAttention-2 style), so memory is
  linear in T, and blocks above the diagonal are never computed.
- ``flex``: ``flex_attention`` with a block mask over the concatenated keys (GPU; compiled).

Shapes: q ``[B, Hq, T, D]``; k0, v0 ``[B, Hkv, T, D]`` (step 0); kd, vd ``[B, Hkv, J, T, D]``
(steps 1..k, J = k, possibly 0); document_ids ``[B, T]`` (-1 = padding). Hq is a multiple of Hkv (GQA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("auto", "flex", "sdpa", "dense")
BLOCK_ROWS = 256  # query rows per block of the memory-linear path (scores: Hq * 256 * T floats)


def resolve_attention(name: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` (memory-linear) elsewhere; checks the name."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"drafter.attention={name!r}: expected one of {list(IMPLEMENTATIONS)}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return name


def ttt_attention(q, k0, v0, kd, vd, document_ids, impl: str = "sdpa"):
    """Attention of TTT step J (= kd.shape[2]); returns ``[B, Hq, T, D]``. See the module docstring."""
    impl = resolve_attention(impl, q.device)
    if impl == "dense":
        return _dense(q, k0, v0, kd, vd, document_ids)
    if impl == "flex":
        return _flex(q, k0, v0, kd, vd, document_ids)
    return _BlockedTTTAttention.apply(q, k0, v0, kd, vd, document_ids)


def ttt_dense_mask(document_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference mask ``[B, 1, T, (steps+1) T]``: causal same-document over step 0, identity after."""
    T = document_ids.shape[1]
    idx = torch.arange(T, device=document_ids.device)
    causal = (idx[None, :] <= idx[:, None])[None] & (document_ids[:, :, None] == document_ids[:, None, :])
    eye = torch.eye(T, dtype=torch.bool, device=document_ids.device).expand(causal.shape[0], T, T)
    return torch.cat([causal] + [eye] * steps, dim=-1)[:, None]


def _concat_keys(k0, kd):
    B, H, J, T, D = kd.shape
    return torch.cat([k0, kd.reshape(B, H, J * T, D)], dim=2)


def _dense(q, k0, v0, kd, vd, document_ids):
    mask = ttt_dense_mask(document_ids, kd.shape[2])
    return F.scaled_dot_product_attention(q, _concat_keys(k0, kd), _concat_keys(v0, vd), attn_mask=mask, enable_gqa=True)


_compiled_flex = None


def _flex(q, k0, v0, kd, vd, document_ids):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    B, _, T, _ = q.shape
    J = kd.shape[2]
    doc = document_ids

    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // T
        kv = kv_idx - step * T
        causal = (kv <= q_idx) & (doc[b, kv] == doc[b, q_idx])
        return ((step == 0) & causal) | ((step > 0) & (kv == q_idx))

    block_mask = create_block_mask(mask_mod, B, None, T, (J + 1) * T, device=q.device)
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    return fn(q, _concat_keys(k0, kd), _concat_keys(v0, vd), block_mask=block_mask, enable_gqa=True)


def _block_scores(qb, k0, kdb, doc, a, b, scale):
    """Scores of query rows a..b-1 (qb ``[B, Hkv, G, n, D]``), at least fp32.

    Causal part ``[B, Hkv, G, n, b]`` (keys 0..b-1; the G query heads of a kv head are folded into the
    rows of one matmul) and diagonal part ``[B, Hkv, G, n, J]``.
    """
    B, Hkv, G, n, D = qb.shape
    acc = torch.promote_types(qb.dtype, torch.float32)  # softmax in fp32 even for bf16 inputs
    s = torch.matmul(qb.reshape(B, Hkv, G * n, D), k0[:, :, :b].transpose(-1, -2)).to(acc)
    s = s.view(B, Hkv, G, n, b) * scale
    rows = torch.arange(a, b, device=qb.device)
    cols = torch.arange(b, device=qb.device)
    allowed = (cols[None, :] <= rows[:, None])[None] & (doc[:, a:b, None] == doc[:, None, :b])
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    sd = torch.einsum("bhgtd,bhjtd->bhgtj", qb, kdb).to(acc) * scale
    return s, sd


def _fold(x):
    """``[B, Hkv, G, n, X]`` -> ``[B, Hkv, G * n, X]`` (a copy only when x is a slice)."""
    return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


class _BlockedTTTAttention(torch.autograd.Function):
    """Joint softmax over causal step-0 keys and diagonal keys, one query block at a time."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, doc):
        B, Hq, T, D = q.shape
        Hkv = k0.shape[1]
        G = Hq // Hkv
        scale = 1.0 / math.sqrt(D)
        qg = q.view(B, Hkv, G, T, D)  # query heads grouped under their kv head
        out = torch.empty_like(qg)
        lse = torch.empty(B, Hkv, G, T, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for a in range(0, T, BLOCK_ROWS):
            b = min(a + BLOCK_ROWS, T)
            qb, kdb, vdb = qg[:, :, :, a:b], kd[:, :, :, a:b], vd[:, :, :, a:b]
            s, sd = _block_scores(qb, k0, kdb, doc, a, b, scale)
            m = s.amax(-1)  # finite: every row sees its own step-0 key
            if sd.shape[-1]:
                m = torch.maximum(m, sd.amax(-1))
            p, pd = torch.exp(s - m[..., None]), torch.exp(sd - m[..., None])
            l = p.sum(-1) + pd.sum(-1)
            o = torch.matmul(_fold(p.to(q.dtype)), v0[:, :, :b]).view(B, Hkv, G, b - a, D)
            o = o + torch.einsum("bhgtj,bhjtd->bhgtd", pd.to(q.dtype), vdb)
            out[:, :, :, a:b] = o / l[..., None].to(q.dtype)
            lse[:, :, :, a:b] = m + torch.log(l)
        ctx.save_for_backward(q, k0, v0, kd, vd, doc, out, lse)
        return out.view(B, Hq, T, D)

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, doc, out, lse = ctx.saved_tensors
        B, Hq, T, D = q.shape
        Hkv = k0.shape[1]
        G = Hq // Hkv
        scale = 1.0 / math.sqrt(D)
        qg = q.view(B, Hkv, G, T, D)
        do = grad_out.reshape(B, Hkv, G, T, D)
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [B, Hkv, G, T]: rowsum(dO * O)
        dq = torch.empty_like(qg)
        dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
        dkd, dvd = torch.empty_like(kd), torch.empty_like(vd)
        for a in range(0, T, BLOCK_ROWS):
            b = min(a + BLOCK_ROWS, T)
            n = b - a
            qb, kdb, vdb, dob = qg[:, :, :, a:b], kd[:, :, :, a:b], vd[:, :, :, a:b], do[:, :, :, a:b]
            s, sd = _block_scores(qb, k0, kdb, doc, a, b, scale)
            lb, db = lse[:, :, :, a:b, None], delta[:, :, :, a:b, None]
            p, pd = torch.exp(s - lb).to(q.dtype), torch.exp(sd - lb).to(q.dtype)
            dob_f = _fold(dob)
            dv0[:, :, :b] += torch.matmul(_fold(p).transpose(-1, -2), dob_f)
            dp = torch.matmul(dob_f, v0[:, :, :b].transpose(-1, -2)).view(B, Hkv, G, n, b)
            ds = p * (dp - db) * scale
            dsd = pd * (torch.einsum("bhgtd,bhjtd->bhgtj", dob, vdb) - db) * scale
            dqb = torch.matmul(_fold(ds), k0[:, :, :b]).view(B, Hkv, G, n, D)
            dq[:, :, :, a:b] = dqb + torch.einsum("bhgtj,bhjtd->bhgtd", dsd, kdb)
            dk0[:, :, :b] += torch.matmul(_fold(ds).transpose(-1, -2), _fold(qb))
            dkd[:, :, :, a:b] = torch.einsum("bhgtj,bhgtd->bhjtd", dsd, qb)
            dvd[:, :, :, a:b] = torch.einsum("bhgtj,bhgtd->bhjtd", pd, dob)
        return dq.view(B, Hq, T, D), dk0, dv0, dkd, dvd, None


def cached_attention(q, k, v):
    """Engine attention: the last S keys are the queries' own (causal among them), all earlier keys visible.

    q ``[B, Hq, S, D]``, k/v ``[B, Hkv, L, D]`` with L >= S (the cache after appending this chunk).
    """
    S, L = q.shape[2], k.shape[2]
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    mask = j <= i + (L - S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
