"""Memory-linear TTT attention == the dense-mask reference (values and grads, packed rows, GQA)."""

import pytest
import torch

from fledge.models.attention import cached_attention, ttt_attention, ttt_dense_mask

LAYOUTS = {  # per row of document ids; T = 23
    "packed+pad": [[0] * 7 + [1] * 12 + [-1] * 4, [0] * 23],  # rows with different runs
    "singletons": [[0, 1, 2] + [3] * 18 + [4, -1], [0] * 22 + [1]],  # documents of length 1
    "shared": [[0] * 5 + [1] * 16 + [-1] * 2] * 2,  # identical rows share one flash call per run
}


def inputs(J, B=2, Hq=4, Hkv=2, T=23, D=8, seed=0, layout="packed+pad"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    rows = LAYOUTS[layout] if T == 23 else [[0] * T] * 2
    doc = torch.tensor(rows[:B], dtype=torch.int32)
    q = mk(B, T, Hq, D).transpose(1, 2)  # the drafter's layout: heads split from [B, T, Hq * D]
    return q, mk(B, Hkv, T, D), mk(B, Hkv, T, D), mk(B, Hkv, J, T, D), mk(B, Hkv, J, T, D), doc


def test_dense_mask_layout():
    doc = torch.tensor([[0, 0, 1, 1]])
    m = ttt_dense_mask(doc, 2)[0, 0]
    assert m.shape == (4, 12)
    assert m[3, :4].tolist() == [False, False, True, True]  # causal, same document only
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(m[:, 8:], m[:, 4:8])


@pytest.mark.parametrize("J", [0, 1, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_linear_equals_dense(J, layout):
    q, k0, v0, kd, vd, doc = inputs(J, layout=layout)
    out = ttt_attention(q, k0, v0, kd, vd, doc, "sdpa")
    ref = ttt_attention(q, k0, v0, kd, vd, doc, "dense")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    leaves = [q, k0, v0, kd, vd]
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, leaves, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    if J:  # the diagonal keys really matter
        assert (ref - ttt_attention(q, k0, v0, kd[:, :, :0], vd[:, :, :0], doc, "dense")).abs().max() > 1e-3


def test_documents_do_not_leak():
    q, k0, v0, kd, vd, doc = inputs(2)
    out = ttt_attention(q, k0, v0, kd, vd, doc, "sdpa")
    k0b = k0.detach().clone()
    k0b[0, :, :7] += 5.0  # change document 0 of row 0
    v0b = v0.detach().clone()
    v0b[0, :, :7] += 5.0
    out2 = ttt_attention(q, k0b, v0b, kd, vd, doc, "sdpa")
    assert torch.equal(out[0, :, 7:19], out2[0, :, 7:19])  # document 1 untouched
    assert (out[0, :, :7] - out2[0, :, :7]).abs().max() > 1e-3


def test_padding_is_finite_and_isolated():
    q, k0, v0, kd, vd, doc = inputs(2)
    out = ttt_attention(q, k0, v0, kd, vd, doc, "sdpa")
    assert torch.isfinite(out).all()
    real = (doc >= 0)[:, None, :, None]
    grads = torch.autograd.grad((out * real).sum(), [q, k0, v0, kd, vd])
    pad = ~real
    for g in grads:  # real rows never read padding keys, so padding gets no gradient from them
        mask = pad if g.dim() == 4 else pad[:, :, None]
        assert torch.equal(g * mask, torch.zeros_like(g))
    assert all(g.abs().sum() > 0 for g in grads)


def test_bf16_close_to_dense():
    *xs, doc = inputs(3)
    xs = [x.detach().bfloat16().requires_grad_() for x in xs]
    ref_in = [x.detach().float().requires_grad_() for x in xs]
    out = ttt_attention(*xs, doc, "sdpa")
    ref = ttt_attention(*ref_in, doc, "dense")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, xs, grad.bfloat16())
    want = torch.autograd.grad(ref, ref_in, grad)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_non_contiguous_document_refused():
    q, k0, v0, kd, vd, _ = inputs(1)
    doc = torch.tensor([[0] * 10 + [1] * 5 + [0] * 8, [0] * 23], dtype=torch.int32)
    with pytest.raises(ValueError, match="document_ids row 0"):
        ttt_attention(q, k0, v0, kd, vd, doc, "sdpa")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_forward_equals_dense_at_every_step(layout):
    """flex (eager on CPU: its forward runs, its backward does not) with one TTTMask reused by steps 0..3,
    multi-document and padded rows: equal to the dense reference at every step. flex's eager path reads
    only the mask_mod; the block tables are checked against torch's own in the next test."""
    from fledge.models.attention import TTTMask

    K = 4
    *_, doc = inputs(0, layout=layout)
    mask = TTTMask(doc, K)
    for J in range(K):
        q, k0, v0, kd, vd, _ = (x.detach().float() if x.is_floating_point() else x for x in inputs(J, layout=layout))
        out = ttt_attention(q, k0, v0, kd, vd, mask, "flex")
        torch.testing.assert_close(out, ttt_attention(q, k0, v0, kd, vd, doc, "dense"), atol=1e-5, rtol=1e-5)


def _block_sets(bm):
    """{(b, q block): (partial key blocks, full key blocks)} of a BlockMask."""
    def sets(num, idx):
        return {(b, i): frozenset(idx[b, 0, i, : num[b, 0, i]].tolist()) for b in range(num.shape[0])
                for i in range(num.shape[2])}
    part, full = sets(bm.kv_num_blocks, bm.kv_indices), sets(bm.full_kv_num_blocks, bm.full_kv_indices)
    return {key: (part[key], full[key]) for key in part}


def test_flex_block_tables_are_create_block_masks_at_every_step():
    """TTTMask's block tables, built once for K steps and cut to step J's keys, equal what torch's
    create_block_mask builds for step J from the mask_mod (materialising the whole mask): partial and full
    blocks, multi-document rows with padding, T not a multiple of the block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fledge.models.attention import TTTMask, _ttt_mask_mod

    T, K, bs = 53, 4, 8
    doc = torch.tensor([[0] * 20 + [1] * 3 + [2] * 25 + [-1] * 5, [0] * 9 + [1] * 44], dtype=torch.int32)
    mask = TTTMask(doc, K, block_size=bs)
    for J in range(K):
        got = mask.block_mask(J)
        want = create_block_mask(_ttt_mask_mod(doc, T), 2, None, T, (J + 1) * T, device="cpu", BLOCK_SIZE=bs)
        assert got.seq_lengths == want.seq_lengths == (T, (J + 1) * T)
        g, w = _block_sets(got), _block_sets(want)
        assert g == w, J
        assert any(full for _, full in w.values()) and any(part for part, _ in w.values())


def test_the_mask_is_built_once_per_batch(monkeypatch):
    """A K-step unroll of a flex drafter evaluates the mask once (not once per step or layer), and its
    outputs at every step equal the dense drafter's (multi-document rows)."""
    import torch.nn.attention.flex_attention as FA

    import fledge.models.attention as A
    from fledge.models.alignment import ttt_states
    from tests.helpers.models import make_drafter, packed_batch

    builds = []  # element-level mask evaluations: TTTMask's block tables, or create_block_mask (per step before)
    for mod, name in ((A, "_block_tables"), (FA, "create_block_mask")):
        real = getattr(mod, name, None)
        if real is not None:
            monkeypatch.setattr(mod, name,
                                lambda *a, _real=real, _name=name, **kw: builds.append(_name) or _real(*a, **kw))
    K, b = 4, packed_batch()
    with torch.no_grad():
        ys = ttt_states(make_drafter(attention="flex"), b, K)
        assert len(builds) == 1, f"{len(builds)} mask builds for one {K}-step batch"
        ttt_states(make_drafter(attention="flex"), packed_batch(seed=2), K)  # a second batch: one more
        assert len(builds) == 2
        ref = ttt_states(make_drafter(attention="dense"), b, K)
    for k in range(K):
        torch.testing.assert_close(ys[k], ref[k], atol=1e-5, rtol=1e-5)


def test_cached_attention_prefill_then_decode():
    q, k0, v0, *_ = inputs(0, B=1, T=9)
    full = torch.nn.functional.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(cached_attention(q, k0, v0), full)
    torch.testing.assert_close(cached_attention(q[:, :, -1:], k0, v0), full[:, :, -1:])


def test_bad_name():
    with pytest.raises(ValueError, match="drafter.attention"):
        ttt_attention(*inputs(1), impl="eager")
