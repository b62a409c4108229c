"""The kernels' torch paths: chunked loss vs the materialised one and vs the formula, fp8, RMSNorm."""

from __future__ import annotations

import pytest
import torch

from fledge.models.kernels import (
    RMSNorm,
    dequantize_e4m3,
    draft_logsumexp,
    fused_draft_loss,
    quantize_e4m3,
    rms_norm,
    teacher_expectation,
)


def _inputs(dtype=torch.float32, n=45, h=32, ht=24, vd=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, h, generator=g).to(dtype)
    w_d = (torch.randn(vd, h, generator=g) * 0.3).to(dtype)
    t = torch.randn(n, ht, generator=g).to(dtype)
    w_t = (torch.randn(vd, ht, generator=g) * 0.5).to(dtype)
    m = (torch.rand(n, generator=g) > 0.3).float()
    return y, w_d, t, w_t, m


def _grads(impl, inputs, reduction="sum", chunk_size=8):
    y, w_d, t, w_t, m = (x.clone() for x in inputs)
    y.requires_grad_()
    w_d.requires_grad_()
    loss, arg = fused_draft_loss(y, w_d, t, w_t, m, impl=impl, chunk_size=chunk_size, reduction=reduction)
    up = torch.linspace(-1, 2, m.numel()) if reduction == "none" else torch.tensor(0.7)
    (loss * up).sum().backward()
    return loss.detach(), arg, y.grad, w_d.grad


def test_naive_matches_the_formula_of_spec_section_4():
    y, w_d, t, w_t, m = _inputs()
    p = torch.softmax(t @ w_t.T, -1)
    b = y @ w_d.T
    want = (m * (torch.logsumexp(b, -1) - (p * b).sum(-1))).sum()
    loss, arg = fused_draft_loss(y, w_d, t, w_t, m, impl="naive")
    torch.testing.assert_close(loss, want)
    assert torch.equal(arg, b.argmax(-1))
    # dL/db = m * (softmax(b) - p), so dL/dy = that @ W_d.
    y2 = y.clone().requires_grad_()
    fused_draft_loss(y2, w_d, t, w_t, m, impl="naive")[0].backward()
    torch.testing.assert_close(y2.grad, (m[:, None] * (torch.softmax(b, -1) - p)) @ w_d)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("chunk_size", [7, 1000])
def test_chunked_matches_naive(reduction, chunk_size):
    inputs = _inputs()
    got, want = _grads("chunked", inputs, reduction, chunk_size), _grads("naive", inputs, reduction)
    assert torch.equal(got[1], want[1])
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_bf16_keeps_dtypes_and_fp32_loss():
    inputs = _inputs(torch.bfloat16)
    loss, _, dy, dw = _grads("chunked", inputs)
    ref = _grads("naive", tuple(x.float() for x in inputs))
    assert loss.dtype == torch.float32 and dy.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref[0], rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(dw.float(), ref[3], rtol=5e-2, atol=2e-2)


def test_the_two_pieces_match_their_formulas(monkeypatch):
    """teacher_expectation = softmax(t W_t^T) W_d (gradient in W_d only); draft_logsumexp = logsumexp and
    argmax of y W_d^T. Chunking, including the Vd-bounded teacher chunks, changes nothing."""
    import fledge.models.kernels.fused_loss as FL

    y, w_d, t, w_t, _ = _inputs()
    monkeypatch.setattr(FL, "TEACHER_CHUNK_ELEMENTS", 3 * w_t.shape[0])  # 3-row teacher chunks
    up = torch.randn(y.shape[0], y.shape[1])
    w1, w2 = w_d.clone().requires_grad_(), w_d.clone().requires_grad_()
    q = teacher_expectation(t, w_t, w1, chunk_size=1000)
    want = torch.softmax(t @ w_t.T, -1) @ w2
    torch.testing.assert_close(q, want)
    (q * up).sum().backward()
    (want * up).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)
    for impl in ("chunked", "naive"):
        yi, wi = y.clone().requires_grad_(), w_d.clone().requires_grad_()
        lse, arg = draft_logsumexp(yi, wi, impl=impl, chunk_size=4)
        b = y @ w_d.T
        torch.testing.assert_close(lse, torch.logsumexp(b, -1))
        assert torch.equal(arg, b.argmax(-1))
        (lse * up[:, 0]).sum().backward()
        d = torch.softmax(b, -1) * up[:, :1]
        torch.testing.assert_close(yi.grad, d @ w_d)
        torch.testing.assert_close(wi.grad, d.T @ y)


def test_draft_cross_entropy_matches_autograd_and_keeps_no_copies():
    """lse(y W^T) - y . q[index] with repeated teacher rows: values and gradients in y, W and q equal plain
    autograd of the formula; backward keeps y, W, q, index and one fp32 lse per row, nothing [N, H]-sized."""
    from fledge.models.kernels import draft_cross_entropy

    g = torch.Generator().manual_seed(1)
    y = torch.randn(9, 16, generator=g).requires_grad_()
    w = torch.randn(30, 16, generator=g).requires_grad_()
    q = torch.randn(5, 16, generator=g).requires_grad_()
    idx = torch.tensor([0, 4, 4, 1, 2, 3, 0, 0, 2])
    up = torch.randn(9, generator=g)
    got, arg = draft_cross_entropy(y, w, q, idx, impl="chunked", chunk_size=4)
    (got * up).sum().backward()
    y2, w2, q2 = (x.detach().clone().requires_grad_() for x in (y, w, q))
    want = torch.logsumexp(y2 @ w2.T, -1) - (y2 * q2[idx]).sum(-1)
    (want * up).sum().backward()
    torch.testing.assert_close(got, want)
    assert torch.equal(arg, (y2 @ w2.T).argmax(-1))
    for a, b in ((y, y2), (w, w2), (q, q2)):
        torch.testing.assert_close(a.grad, b.grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        draft_cross_entropy(y, w, q, idx, impl="chunked")
    mine = {x.untyped_storage().data_ptr() for x in (y, w, q, idx)}
    extra = [t for t in saved if t.untyped_storage().data_ptr() not in mine]
    assert [(t.shape, t.dtype) for t in extra] == [((9,), torch.float32)]  # the lse


def test_masked_rows_do_not_count():
    y, w_d, t, w_t, m = _inputs()
    keep = m.bool()
    full, _ = fused_draft_loss(y, w_d, t, w_t, m)
    kept, _ = fused_draft_loss(y[keep], w_d, t[keep], w_t, m[keep], impl="naive")
    torch.testing.assert_close(full, kept)


def test_bad_arguments_raise_value_error():
    y, w_d, t, w_t, m = _inputs()
    with pytest.raises(ValueError, match="impl"):
        fused_draft_loss(y, w_d, t, w_t, m, impl="cuda")
    with pytest.raises(ValueError, match="W_t"):
        fused_draft_loss(y, w_d, t, w_t[:-1], m)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_draft_loss(y, w_d, t, w_t, m, chunk_size=0)


def test_fp8_torch_round_trip_error_bound():
    x = torch.randn(4, 6, 64) * torch.logspace(-4, 4, 6).view(1, 6, 1)
    q, s = quantize_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 6)
    back = dequantize_e4m3(q, s, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, except near zero where subnormals step by
    # scale * 2**-9.
    assert ((back - x).abs() <= x.abs() * 2**-4 + s[..., None] * 2**-9).all()
    torch.testing.assert_close(q.float().abs().amax(-1), torch.full((4, 6), 448.0))


def test_rmsnorm_module_torch_path_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(ours(x), ref(x))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(47))


def test_rmsnorm_torch_path_in_bf16_is_close_to_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    ours = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(ref.weight)
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 5
    out = ours(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref(x).float(), rtol=2**-7, atol=1e-2)  # one bf16 rounding apart


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_rmsnorm_triton_on_cpu_says_how_to_fix():
    with pytest.raises(ValueError, match="norm_impl=torch"):
        rms_norm(torch.randn(2, 8), torch.ones(8), impl="triton")
    with pytest.raises(ValueError, match="impl"):
        rms_norm(torch.randn(2, 8), torch.ones(8), impl="fast")


def test_drafter_norm_impl_reaches_every_norm_and_keeps_the_state_dict():
    from tests.helpers.models import make_drafter
    d = make_drafter(fc_norm=True, norm_output=True)
    names = [n for n, m in d.named_modules() if isinstance(m, RMSNorm)]
    assert len(names) == 3 + 4  # fc_norm x 3 aux states, input/hidden/post-attention norms, final norm
    d.norm_impl = "triton"
    assert {m.impl for m in d.modules() if isinstance(m, RMSNorm)} == {"triton"}
    assert "midlayer.input_layernorm.weight" in d.state_dict() and "norm.weight" in d.state_dict()
    with pytest.raises(ValueError, match="drafter.norm_impl"):
        d.norm_impl = "fast"


def test_dtype_mismatch_raises():
    y, w_d, t, w_t, m = _inputs()
    with pytest.raises(ValueError, match="dtype"):
        fused_draft_loss(y.bfloat16(), w_d, t, w_t, m)


def test_fp32_products_from_bf16_parts_are_fp32_accurate(monkeypatch):
    """On CUDA mm_f32 multiplies bf16 hi + lo parts of fp32 operands on tensor cores; run that splitting on
    CPU with an exact bf16 x bf16 -> fp32 product: hi + lo carry 16 bits (error ~2^-17, where rounding the fp32
    operand to bf16 alone is ~2^-9: >100x worse), in output-row blocks smaller than the result."""
    import fledge.models.kernels.fp32_accum as A

    monkeypatch.setattr(A, "BLOCK_ELEMENTS", 3 * 20)  # 3-row blocks
    g = torch.Generator().manual_seed(0)
    exact = lambda x, y: x.float() @ y.float()  # noqa: E731  (bf16 products are exact in fp32)
    p = torch.softmax(torch.randn(37, 50, generator=g) * 3, -1)  # fp32, like the softmax weights
    w = torch.randn(50, 20, generator=g).bfloat16()  # a bf16 weight
    gq = torch.randn(37, 20, generator=g)  # fp32, like the teacher's upstream gradient
    for a, b in ((p, w), (p.t(), gq)):
        want = a.double() @ b.double()
        got = A.addmm_parts_(torch.zeros(want.shape), a, b, torch.bfloat16, exact)
        rounded = exact(a.bfloat16() if a.dtype == torch.float32 else a, b.bfloat16())
        err, err_bf16 = ((got - want).norm() / want.norm()).item(), ((rounded - want).norm() / want.norm()).item()
        assert err < 1e-5 and err_bf16 > 100 * err, (err, err_bf16)
    # and the grad stand-in: every contribution summed in fp32, rounded once
    x = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    sink = A.fp32_grad(x)
    assert sink.dtype == torch.float32 and sink.shape == x.shape and sink.untyped_storage().nbytes() == 4
    terms = [torch.full((4,), 1.0 + 2**-9), torch.full((4,), -1.0)]  # each term alone rounds 1+2^-9 to 1
    sum(((sink * t).sum() for t in terms), torch.zeros(())).backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, torch.full((4,), 2**-9, dtype=torch.bfloat16))
