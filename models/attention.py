"""Training-time-test attention (docs/architecture.md, Training-time test) and the engine's cached attention.

At TTT step k, row t attends to the step-0 keys 0..t of its own document plus, for every step
j = 1..k, only the key that step produced at row t. With keys concatenated over steps the mask is
``[causal & same-doc | I | I | ...]``. Three implementations of that one function:

- ``dense``: the concatenated keys with a dense boolean mask through SDPA. O(T * (k+1) T) memory;
  the reference the tests compare against.
- ``sdpa``: the memory-linear CPU path (``_FlashTTTAttention``). The causal part runs torch's CPU
  flash kernel once per document (documents are contiguous runs of equal ``document_ids``, padding's
  -1 included, so slicing q/k/v to a run and ``is_causal=True`` is the mask), giving ``out_c`` and
  its log-sum-exp ``lse_c``. The k diagonal scores ``s_j = scale * q . k_j`` are row-wise dots. The
  joint softmax is then a merge: ``L = logaddexp(lse_c, s_1..s_k)``, ``out = exp(lse_c - L) out_c +
  sum_j exp(s_j - L) v_j``. Memory is linear in T and nothing above the diagonal is computed.
- ``flex``: ``flex_attention`` with a block mask over the concatenated keys (GPU; compiled).

The mask of a batch is a ``TTTMask``: built from the document ids once per batch and read by every step
and layer. Its flex block tables are evaluated one query block at a time (memory linear in T; the
uncompiled ``create_block_mask`` materialises the [B, 1, T, K T] boolean mask, 470 MB at T = 8192, K = 7),
once for the K-step key layout; step J's block mask is their first key-block columns, since the step-J mask
is a prefix of the K-step one.

Shapes: q ``[B, Hq, T, D]``; k0, v0 ``[B, Hkv, T, D]`` (step 0); kd, vd ``[B, Hkv, J, T, D]``
(steps 1..k, J = k, possibly 0); document_ids ``[B, T]`` (-1 = padding). Hq is a multiple of Hkv (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("auto", "flex", "sdpa", "dense")

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, lse [B, H, T]); GQA ok
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward  # -> dq, dk, dv


def resolve_attention(name: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` (memory-linear) elsewhere; checks the name."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"drafter.attention={name!r}: expected one of {list(IMPLEMENTATIONS)}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "sdpa" and device.type != "cpu":
        raise ValueError(f"drafter.attention='sdpa' runs torch's CPU flash kernel; on {device.type} use auto or flex")
    return name


def ttt_attention(q, k0, v0, kd, vd, mask, impl: str = "sdpa"):
    """Attention of TTT step J (= kd.shape[2]); returns ``[B, Hq, T, D]``. See the module docstring.

    ``mask``: the batch's ``TTTMask`` (build it once per batch, so every step reuses it), or its document
    ids ``[B, T]`` (a mask for this call alone)."""
    impl = resolve_attention(impl, q.device)
    J = kd.shape[2]
    if not isinstance(mask, TTTMask):
        mask = TTTMask(mask, J + 1)
    if impl == "dense":
        return _dense(q, k0, v0, kd, vd, mask.document_ids)
    if impl == "flex":
        return _flex(q, k0, v0, kd, vd, mask.block_mask(J))
    return _FlashTTTAttention.apply(q, k0, v0, kd, vd, mask.segments)


def ttt_attention_over(q, kv: list, mask, impl: str = "sdpa"):
    """TTT attention of step J = len(kv) - 1 over a step's key/value list: ``kv[0]`` the context's keys and values,
    ``kv[1:]`` each later step's own (its diagonal), as the drafters append them step by step."""
    k0, v0 = kv[0]
    diag = kv[1:]
    if diag:
        kd, vd = torch.stack([d[0] for d in diag], 2), torch.stack([d[1] for d in diag], 2)
    else:
        kd, vd = k0[:, :, None][:, :, :0], v0[:, :, None][:, :, :0]  # J = 0
    return ttt_attention(q, k0, v0, kd, vd, mask, impl)


class TTTMask:
    """One batch's TTT attention mask for steps 0..``steps``-1, built once and shared by every step.

    ``document_ids`` ``[B, T]`` (-1 = padding). Each implementation reads its own form, computed on first
    use and kept: ``segments`` (the sdpa path's document runs) and ``block_mask(J)`` (flex).
    ``block_size`` is flex's sparse block size (tests shrink it to get many blocks from a short T).
    """

    def __init__(self, document_ids: torch.Tensor, steps: int, block_size: int = 128) -> None:
        if steps < 1:
            raise ValueError(f"TTTMask: steps={steps}; need >= 1")
        self.document_ids, self.steps, self.block_size = document_ids, steps, block_size
        self._segments = None
        self._tables = self._mask_mod = None

    @property
    def segments(self) -> list[tuple[slice, int, int]]:
        """``document_segments(document_ids)``, computed once."""
        if self._segments is None:
            self._segments = document_segments(self.document_ids)
        return self._segments

    def block_mask(self, J: int):
        """flex's BlockMask of step ``J`` (keys of steps 0..J, ``(J + 1) T``): the first key-block columns of
        the ``steps``-step block tables, which are computed once per mask (``_block_tables``)."""
        from torch.nn.attention.flex_attention import BlockMask

        if not 0 <= J < self.steps:
            raise ValueError(f"TTTMask built for {self.steps} steps; step {J} asked")
        T, bs = self.document_ids.shape[1], self.block_size
        if self._tables is None:
            self._tables = _block_tables(self.document_ids, self.steps, bs)
            self._mask_mod = _ttt_mask_mod(self.document_ids, T)  # one function for every step's BlockMask
        cols = -(-(J + 1) * T // bs)
        tables = []
        for whole, edge in zip(self._tables[:2], self._tables[2:]):
            x = whole[..., :cols].clone()
            x[..., -1] = edge[J]  # the last column as cut at (J + 1) T, not as the K-step layout fills it
            tables.append(_ordered(x))
        return BlockMask.from_kv_blocks(*tables[0], *tables[1], BLOCK_SIZE=bs, mask_mod=self._mask_mod,
                                        seq_lengths=(T, (J + 1) * T))


def _ttt_mask_mod(doc: torch.Tensor, T: int):
    """flex's element mask over keys concatenated over steps (key kv_idx: step kv_idx // T, row kv_idx % T)."""

    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // T
        kv = kv_idx - step * T
        causal = (kv <= q_idx) & (doc[b, kv] == doc[b, q_idx])
        return ((step == 0) & causal) | ((step > 0) & (kv == q_idx))

    return mask_mod


def _block_tables(document_ids: torch.Tensor, steps: int, bs: int) -> tuple[torch.Tensor, ...]:
    """Block tables of the ``steps``-step mask: (partial, full) bool ``[B, 1, nQ, nK]``, a block being full
    when every (query, key) in it is allowed, partial when some but not all are (flex applies mask_mod
    there); then (edge_partial, edge_full) ``[steps, B, 1, nQ]``: step J's last key-block column, the one
    its key length (J + 1) T cuts (keys past the cut count as masked).

    Evaluated one query block at a time: memory O(B bs steps T), against O(B steps T^2) for the whole
    boolean mask. Positions past T count as masked, as in create_block_mask's padding.
    """
    B, T = document_ids.shape
    dev = document_ids.device
    n_q, n_k = -(-T // bs), -(-steps * T // bs)
    pos = torch.arange(T, device=dev)
    rows = torch.zeros(B, bs, n_k * bs, dtype=torch.bool, device=dev)  # one query block's mask, reused
    partial = torch.empty(B, 1, n_q, n_k, dtype=torch.bool, device=dev)
    full = torch.empty_like(partial)
    edge_partial = torch.empty(steps, B, 1, n_q, dtype=torch.bool, device=dev)
    edge_full = torch.empty_like(edge_partial)

    def summarize(tiles):  # [B, bs, n, bs] -> (partial, full) [B, n]
        all_ = tiles.all(-1).all(1)
        return tiles.any(-1).any(1) & ~all_, all_

    for i in range(n_q):
        qs = pos[i * bs:(i + 1) * bs]
        n = qs.numel()
        rows[:, :n, :T] = (pos <= qs[:, None]) & (document_ids[:, None, :] == document_ids[:, qs, None])
        rows[:, :n, T:steps * T].view(B, n, steps - 1, T).copy_((pos == qs[:, None])[None, :, None])
        rows[:, n:] = False  # the last block's rows past T
        partial[:, 0, i], full[:, 0, i] = summarize(rows.view(B, bs, n_k, bs))
        for J in range(steps):
            end = (J + 1) * T
            c = (end - 1) // bs
            tile = rows[..., c * bs:(c + 1) * bs] & (torch.arange(c * bs, (c + 1) * bs, device=dev) < end)
            p, f = summarize(tile[:, :, None])
            edge_partial[J, :, 0, i], edge_full[J, :, 0, i] = p[:, 0], f[:, 0]
    return partial, full, edge_partial, edge_full


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense bool block table ``[B, H, nQ, nK]`` -> (count per row, column indices with the used ones
    first, ascending), int32: the form ``BlockMask.from_kv_blocks`` takes."""
    dense = dense.to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def ttt_dense_mask(document_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference mask ``[B, 1, T, (steps+1) T]``: causal same-document over step 0, identity after."""
    T = document_ids.shape[1]
    idx = torch.arange(T, device=document_ids.device)
    causal = (idx[None, :] <= idx[:, None])[None] & (document_ids[:, :, None] == document_ids[:, None, :])
    eye = torch.eye(T, dtype=torch.bool, device=document_ids.device).expand(causal.shape[0], T, T)
    return torch.cat([causal] + [eye] * steps, dim=-1)[:, None]


def document_segments(document_ids: torch.Tensor) -> list[tuple[slice, int, int]]:
    """``[B, T]`` ids -> ``(rows, start, end)`` runs of one id, one flash call each.

    Rows with identical ids share their calls. An id that comes back after another (``0 0 1 0``)
    would let the later run see the earlier one, which per-run causal attention cannot express.
    """
    B, T = document_ids.shape
    same = B == 1 or bool((document_ids == document_ids[:1]).all())
    segments = []
    for r in [0] if same else range(B):
        row = document_ids[r]
        cuts = ((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist()
        bounds = [0, *cuts, T]
        if len(bounds) - 1 != row.unique().numel():
            raise ValueError(
                f"document_ids row {r}: a document id occurs in two separate runs; packed documents must be "
                "contiguous (as data/features/packing.py writes them), or use drafter.attention=dense"
            )
        rows = slice(0, B) if same else slice(r, r + 1)
        segments += [(rows, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return segments


def _concat_keys(k0, kd):
    B, H, J, T, D = kd.shape
    return torch.cat([k0, kd.reshape(B, H, J * T, D)], dim=2)


def _dense(q, k0, v0, kd, vd, document_ids):
    mask = ttt_dense_mask(document_ids, kd.shape[2])
    return F.scaled_dot_product_attention(q, _concat_keys(k0, kd), _concat_keys(v0, vd), attn_mask=mask,
                                          enable_gqa=True)


_compiled_flex = None


def _flex(q, k0, v0, kd, vd, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            # One compile per key length (J + 1) * T: K steps of training plus the 2K held-out steps (at one
            # row length per eval run, evaluation/heldout.py) pass dynamo's default limit of 8, past which it would
            # silently run the eager flex_attention, which materialises the full score matrix.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    k, v = _concat_keys(k0, kd), _concat_keys(v0, vd)
    Dv = v.shape[-1]
    q, k, v = (_widen(x, FLEX_MIN_HEAD_DIM) for x in (q, k, v))  # on every device, so CPU tests cover it
    # The scale is the unpadded width's: zero columns add nothing to q . k, and v's are cut off below.
    return fn(q, k, v, block_mask=block_mask, scale=k0.shape[-1] ** -0.5, enable_gqa=True)[..., :Dv]


# Compiled flex on CUDA (Triton's tl.dot) takes head dims of at least 16 ("NYI: embedding dimension ... must be
# at least 16"): a narrower drafter head (tiny test and CI shapes) is zero-padded to it.
FLEX_MIN_HEAD_DIM = 16


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] >= width else F.pad(x, (0, width - x.shape[-1]))


def _diag_scores(qg, kd, scale, acc):
    """Row-wise scores of each query head against its row's step-j key: ``[B, Hkv, G, T, J]`` in ``acc``."""
    return torch.einsum("bhgtd,bhjtd->bhgtj", qg, kd).to(acc) * scale


def _merge_weights(lse_c, sd):
    """Joint-softmax weights: w = exp(lse_c - L) ``[..., T]`` on the causal output, pd ``[..., T, J]``."""
    L = torch.logaddexp(lse_c, torch.logsumexp(sd, -1))  # every row sees its own key: lse_c finite
    return torch.exp(lse_c - L), torch.exp(sd - L[..., None])


def _diag_apply(w, x):
    """``sum_j w[..., j] x_j``: w ``[B, Hkv, G, T, J]``, x ``[B, Hkv, J, T, D]`` -> ``[B, Hkv, G, T, D]``."""
    return torch.einsum("bhgtj,bhjtd->bhgtd", w, x)


class _FlashTTTAttention(torch.autograd.Function):
    """Causal step-0 part via the flash kernel per document, merged with the diagonal keys.

    Backward, with O the merged output, dO its gradient, delta = rowsum(dO * O) and the joint
    probabilities P = w P_c (causal keys; P_c the per-document softmax, w = exp(lse_c - L)) and pd
    (diagonal keys): dS = P (dO . v - delta) for every key. The flash backward called with grad
    ``w dO``, output O and ``lse_c`` forms P_c (w dO . v - rowsum(w dO * O)), exactly the causal part
    of that (and dV = P_c^T w dO); the diagonal part is a few row-wise products.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, segments):
        B, Hq, T, D = q.shape
        Hkv, J = k0.shape[1], kd.shape[2]
        scale = D**-0.5
        acc = torch.promote_types(q.dtype, torch.float32)  # merge in fp32 even for bf16 inputs
        out_c = torch.empty_like(q)
        lse_c = torch.empty(B, Hq, T, dtype=acc, device=q.device)
        for rows, a, b in segments:
            o, lse = _flash(q[rows, :, a:b], k0[rows, :, a:b], v0[rows, :, a:b], 0.0, True, scale=scale)
            out_c[rows, :, a:b], lse_c[rows, :, a:b] = o, lse
        ctx.segments = segments
        if J == 0:
            ctx.save_for_backward(q, k0, v0, kd, vd, out_c, lse_c)
            return out_c
        qg = q.view(B, Hkv, Hq // Hkv, T, D)  # query heads grouped under their kv head
        w, pd = _merge_weights(lse_c.view(qg.shape[:-1]), _diag_scores(qg, kd, scale, acc))
        out = w[..., None] * out_c.view(qg.shape) + _diag_apply(pd, vd.to(acc))
        out = out.to(q.dtype).view(B, Hq, T, D)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse_c, w, pd)  # w, pd: [.., T(, J)], small
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, out, lse_c, *merge = ctx.saved_tensors
        B, Hq, T, D = q.shape
        Hkv, J = k0.shape[1], kd.shape[2]
        G, scale, acc = Hq // Hkv, D**-0.5, lse_c.dtype
        qg, dog = q.view(B, Hkv, G, T, D), grad_out.reshape(B, Hkv, G, T, D).to(acc)
        if J:
            w, pd = merge
            grad_c = (w[..., None] * dog).to(q.dtype).view(B, Hq, T, D)
        else:
            grad_c = grad_out.contiguous()
        dq, dk0, dv0 = torch.empty_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        for rows, a, b in ctx.segments:
            sl = (rows, slice(None), slice(a, b))
            dq[sl], dk0[sl], dv0[sl] = _flash_backward(
                grad_c[sl], q[sl], k0[sl], v0[sl], out[sl], lse_c[sl], 0.0, True, scale=scale
            )
        if J == 0:
            return dq, dk0, dv0, torch.zeros_like(kd), torch.zeros_like(vd), None
        delta = (dog * out.view(B, Hkv, G, T, D).to(acc)).sum(-1, keepdim=True)  # [B, Hkv, G, T, 1]
        dpd = torch.einsum("bhgtd,bhjtd->bhgtj", dog, vd.to(acc))  # dO . v_j
        dsd = pd * (dpd - delta) * scale
        dq = dq.view(B, Hkv, G, T, D) + _diag_apply(dsd, kd.to(acc)).to(q.dtype)
        dkd = torch.einsum("bhgtj,bhgtd->bhjtd", dsd, qg.to(acc)).to(kd.dtype)
        dvd = torch.einsum("bhgtj,bhgtd->bhjtd", pd, dog).to(vd.dtype)
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
