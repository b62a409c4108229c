"""The TTT attention's GPU path (compiled flex_attention with a block mask) against the dense reference.

Skipped without CUDA (tests/conftest.py). Run on a GPU machine: python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from fledge.models.attention import ttt_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(J, T, B=2, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device=DEV, generator=g).to(dtype).requires_grad_()  # noqa: E731
    doc = torch.zeros(B, T, dtype=torch.int32, device=DEV)
    doc[0, T // 3:] = 1  # two packed documents in row 0, then padding
    doc[0, T - 5:] = -1
    return mk(B, Hq, T, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D), mk(B, Hkv, J, T, D), mk(B, Hkv, J, T, D), doc


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 5e-3)])
def test_compiled_flex_equals_dense_for_every_step(dtype, tol):
    # Every TTT step J = 0..6 at two row lengths: 14 compiles. Past dynamo's recompile limit it would
    # silently fall back to eager flex (materialised scores); make that an error here.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for T in (256, 384):
        for J in range(7):
            q, k0, v0, kd, vd, doc = _inputs(J, T, dtype=dtype)
            leaves = (q, k0, v0, kd, vd) if J else (q, k0, v0)
            out = ttt_attention(q, k0, v0, kd, vd, doc, "flex")
            fl = [x.detach().float().requires_grad_() for x in (q, k0, v0, kd, vd)]
            ref = ttt_attention(*fl, doc, "dense")
            grad = torch.randn_like(ref)
            got = torch.autograd.grad(out, leaves, grad.to(dtype))
            want = torch.autograd.grad(ref, fl[: len(leaves)], grad)
            assert _rel(out, ref) < tol, (T, J)
            for a, b in zip(got, want):
                assert _rel(a, b) < tol, (T, J)


def test_flex_memory_is_linear_in_keys():
    """T=8192 at step J=6: the dense scores alone would be B*Hq*T*7T*2 bytes (7.5 GiB here); the compiled
    flex forward+backward must stay far below that."""
    T, J = 8192, 6
    q, k0, v0, kd, vd, doc = _inputs(J, T, B=1, Hq=8, Hkv=2, D=128)
    ttt_attention(q, k0, v0, kd, vd, doc, "flex").sum().backward()  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ttt_attention(q, k0, v0, kd, vd, doc, "flex").sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    dense_scores = 1 * 8 * T * (J + 1) * T * 2
    assert extra < dense_scores / 8, f"extra {extra / 2**20:.0f} MiB vs dense scores {dense_scores / 2**20:.0f} MiB"


def test_block_mask_memory_is_linear_in_T():
    """One batch's TTT block mask at T=8192, K=7, built once and cut for every step: its peak memory stays far
    below the [B, 1, T, 7T] boolean mask (470 MB per row) that an uncompiled create_block_mask materialises
    for the last step alone (measured on CPU: 4.6 GB peak for that one call, 21 MB for TTTMask's seven)."""
    from fledge.models.attention import TTTMask

    T, K = 8192, 7
    doc = torch.zeros(1, T, dtype=torch.int32, device=DEV)
    doc[0, 3000:] = 1
    doc[0, T - 100:] = -1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mask = TTTMask(doc, K)
    masks = [mask.block_mask(J) for J in range(K)]
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    dense = T * K * T  # bytes of the boolean mask
    assert extra < dense / 16, f"block mask peak {extra / 2**20:.0f} MiB vs dense mask {dense / 2**20:.0f} MiB"
    assert masks[-1].seq_lengths == (T, K * T)
