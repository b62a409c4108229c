"""The Triton kernels compiled for a real GPU, at the issue's shapes, against their torch references.

Skipped without CUDA (tests/conftest.py). Run on a GPU machine:
    python -m pytest tests/gpu/test_kernels_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from fledge.models.kernels import dequantize_e4m3, fused_draft_loss, quantize_e4m3, rms_norm

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _loss_inputs(n, h, ht, vd, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    y = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    w_d = (torch.randn(vd, h, device=DEV, generator=g) * h**-0.5).to(dtype)
    t = torch.randn(n, ht, device=DEV, generator=g).to(dtype)
    w_t = (torch.randn(vd, ht, device=DEV, generator=g) * 3 * ht**-0.5).to(dtype)
    m = (torch.rand(n, device=DEV, generator=g) > 0.2).float()
    return y, w_d, t, w_t, m


def _run(impl, inputs, chunk_size=512):
    y, w_d, t, w_t, m = (x.detach().clone() for x in inputs)
    y.requires_grad_()
    w_d.requires_grad_()
    loss, arg = fused_draft_loss(y, w_d, t, w_t, m, impl=impl, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), arg, y.grad.float(), w_d.grad.float()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n,h,vd", [(1000, 4096, 32000), (4096, 4096, 32000), (333, 2048, 1000)])
def test_fused_loss_bf16_matches_fp32_oracle(n, h, vd):
    inputs = _loss_inputs(n, h, h, vd, torch.bfloat16)
    got = _run("triton", inputs)
    ref = _run("chunked", tuple(x.float() for x in inputs))  # fp32 logits: the kernel keeps them fp32 too
    assert abs(got[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    assert (got[1] == ref[1]).float().mean().item() > 0.99  # bf16 inputs may flip near-ties
    assert _rel(got[2], ref[2]) < 1e-2
    assert _rel(got[3], ref[3]) < 1e-2


@pytest.mark.parametrize("impl", ["triton", "chunked"])
def test_bf16_gradients_stay_accurate_near_convergence(impl):
    """train/losses' shared-teacher path in bf16 on tensor cores, drafter close to its teacher (KL ~0.004):
    gradients against fp64 within 1.5x of the standard error (fp32 math, rounded to bf16 once). On a GPU this
    is where the hi/lo split of fp32 operands (the kernel's softmax weights, mm_f32) shows: rounding them
    to bf16 alone costs ~3.5% (tests/helpers/loss_precision.py holds the problem)."""
    from tests.helpers.loss_precision import near_converged, reference_grads, rel_err, shared_teacher_grads

    problem = near_converged(n=2048, h=1024, vd=8000, steps=3, eps=0.03, device=DEV)
    want_dy, want_dw, kl = reference_grads(problem, torch.float64)
    std_dy, std_dw, _ = reference_grads(problem, torch.float32)
    got_dy, got_dw = shared_teacher_grads(problem, impl, chunk_size=512)
    assert kl < 0.01, f"not near convergence: KL {kl:.4f}"
    for name, got, std, want in (("dy", got_dy, std_dy, want_dy), ("dW", got_dw, std_dw, want_dw)):
        err, bound = rel_err(got, want), 1.5 * rel_err(std, want)
        assert err <= bound, f"{name}: relative error {err:.3%} vs fp64, standard {bound / 1.5:.3%}"


@pytest.mark.parametrize("name", ["rkl", "jsd", "tv", "lk_lambda", "lk_alpha"])
def test_fp32_head_path_bf16_gradients_near_convergence(name):
    """The path every loss but ttt_ce takes outside ZeRO-3 (models/kernels/head_loss.py) on tensor cores,
    where mm_f32 splits fp32 operands into bf16 parts for cuBLAS: gradients against fp64 math (the formula
    of train/losses/divergences.py, itself checked against its definition in tests/unit/train/test_loss_family.py)
    within 1.5x of the standard error, as on CPU."""
    from fledge.train.losses import LOSSES
    from tests.helpers.loss_precision import near_converged, path_grads, reference_grads, rel_err

    loss = LOSSES.get(name)(steps=3, step_weight=0.8, chunk_size=512)
    problem = near_converged(n=2048, h=1024, vd=8000, steps=3, eps=0.03, device=DEV)
    want_dy, want_dw, kl = reference_grads(problem, torch.float64, loss.loss_sum)
    std_dy, std_dw, _ = reference_grads(problem, torch.float32, loss.loss_sum)
    got_dy, got_dw = path_grads(problem, "fp32_head", loss.loss_sum, chunk_size=512)
    assert kl < 0.01, f"not near convergence: KL {kl:.4f}"
    for key, got, std, want in (("dy", got_dy, std_dy, want_dy), ("dW", got_dw, std_dw, want_dw)):
        err, bound = rel_err(got, want), 1.5 * rel_err(std, want)
        assert err <= bound, f"{key}: relative error {err:.3%} vs fp64, standard {bound / 1.5:.3%}"


def test_fused_loss_fp32_exact_path():
    inputs = _loss_inputs(777, 512, 384, 5000, torch.float32)
    got, ref = _run("triton", inputs), _run("naive", inputs)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], ref[1])
    assert _rel(got[2], ref[2]) < 1e-5 and _rel(got[3], ref[3]) < 1e-5


def test_fused_loss_memory_is_independent_of_vocab():
    # Extra peak of forward+backward beyond inputs and the gradient buffers: no [N, Vd] term (what grows
    # with Vd is [Vd, H]-sized: gradient buffers; from 8000 to 32000 an [N, Vd] term would add 786 MB).
    n, h = 8192, 1024
    peaks = []
    for vd in (8000, 32000):
        inputs = _loss_inputs(n, h, h, vd, torch.bfloat16)
        y, w_d, t, w_t, m = inputs
        y.requires_grad_()
        w_d.requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fused_draft_loss(y, w_d, t, w_t, m, impl="triton")[0].backward()
        torch.cuda.synchronize()
        grads = n * h * 2 + vd * h * 2  # bf16 .grad tensors that stay allocated
        # the kernel's fp32 dy, and two fp32 dW_d: the stand-in's running fp32 sum of the logsumexp's and the
        # teacher's terms (fused_loss.py: one rounding, after the subtraction) and the term being produced
        fp32_bufs = (n * h + 2 * vd * h) * 4
        peaks.append(torch.cuda.max_memory_allocated() - base - grads - fp32_bufs)
    logits_bytes = n * 8000 * 4
    assert max(peaks) < logits_bytes, f"extra peaks {peaks} B vs one [N, 8000] fp32 logits {logits_bytes} B"
    assert peaks[1] - peaks[0] < n * 24000 * 4 / 4, f"extra peaks {peaks} B grow with Vd"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_kernel(dtype):
    x = (torch.randn(4096, 4096, device=DEV) * 2).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(dtype).requires_grad_()
    dout = torch.randn_like(x)
    out = rms_norm(x, w, 1e-5, impl="triton")
    out.backward(dout)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.nn.functional.rms_norm(x32, (4096,), w32, 1e-5)
    ref.backward(dout.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    assert _rel(out, ref) < tol and _rel(x.grad, x32.grad) < tol and _rel(w.grad, w32.grad) < tol


def test_torch_rms_norm_is_fused_on_cuda():
    """models/kernels/rmsnorm.py's default ("torch") relies on torch dispatching F.rms_norm to its fused
    CUDA kernel when x and w share a dtype: then backward keeps only rstd, not an fp32 copy of x."""
    from scripts.bench_rmsnorm import saved_bytes_per_element

    assert saved_bytes_per_element("torch", 256, 4096, DEV, torch.bfloat16) < 0.01
    assert saved_bytes_per_element("hf", 256, 4096, DEV, torch.bfloat16) > 4


def test_drafter_trains_the_same_with_triton_norms():
    from fledge.train.losses import ttt_loss
    from tests.helpers.models import make_drafter, packed_batch

    losses = {}
    for impl in ("torch", "triton"):
        d = make_drafter(attention="auto").to(DEV)
        d.norm_impl = impl
        b = packed_batch().to(torch.device(DEV))
        head = torch.randn(d.spec.draft_vocab_size, d.spec.target_hidden_size, device=DEV)
        torch.manual_seed(0)
        losses[impl] = ttt_loss(d, b, head, steps=3, step_weight=0.8, chunk_size=7, loss_impl="torch").loss
    assert abs(losses["triton"].item() - losses["torch"].item()) < 1e-4 * abs(losses["torch"].item())


def test_ttt_loss_with_the_kernel_matches_the_torch_path():
    """train/losses on CUDA: the shared-teacher loss through the Triton logsumexp (auto) equals its torch
    chunks (loss_impl=torch), values and every gradient (fp32)."""
    from fledge.train.losses import ttt_loss
    from tests.helpers.models import make_drafter, packed_batch

    out = {}
    for impl in ("auto", "torch"):
        d = make_drafter(attention="auto").to(DEV)
        head = torch.randn(d.spec.draft_vocab_size, d.spec.target_hidden_size,
                           generator=torch.Generator().manual_seed(3)).to(DEV)
        res = ttt_loss(d, packed_batch().to(torch.device(DEV)), head, steps=3, step_weight=0.8, chunk_size=7,
                       loss_impl=impl)
        res.loss.backward()
        out[impl] = (res.loss.item(), {n: p.grad for n, p in d.named_parameters() if p.grad is not None})
    assert abs(out["auto"][0] - out["torch"][0]) < 1e-5 * abs(out["torch"][0])
    for name, g in out["torch"][1].items():
        assert _rel(out["auto"][1][name], g) < 1e-4, name


@pytest.mark.parametrize("shape", [(8192, 4096), (3, 100, 12288)])
def test_fp8_kernels_match_torch(shape):
    x = torch.randn(*shape, device=DEV) * torch.logspace(-3, 3, shape[-2], device=DEV)[:, None]
    q, s = quantize_e4m3(x, impl="triton")
    q_ref, s_ref = quantize_e4m3(x, impl="torch")
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert (q.float() != q_ref.float()).float().mean().item() < 1e-4
    for dtype in (torch.bfloat16, torch.float32):
        torch.testing.assert_close(dequantize_e4m3(q, s, dtype, impl="triton"),
                                   dequantize_e4m3(q, s, dtype, impl="torch"), rtol=0, atol=0)
