"""fp32 accumulation for gradients that are differences of near-equal terms (the soft CE's, fused_loss.py).

Near convergence the drafter's gradient ``(softmax(b) - p) W`` is a small difference of two large terms.
Rounding to bf16 anything that enters it before the subtraction costs a relative error that grows as the
drafter converges. In tests/helpers/loss_precision.py's model at drafter-teacher KL 0.004: the two terms rounded
apart ~4%, the softmax weights multiplying W ~3.5%, the drafter's or the teacher's logits ~19% each,
against 0.17% with fp32 throughout and one rounding of the result. Two helpers keep those terms in fp32:

- ``mm_f32`` / ``addmm_f32_``: a matrix product with an fp32 result (or added to an fp32 accumulator) that
  keeps an fp32 operand to ~16 bits at least, whatever the input dtypes.
- ``fp32_grad``: a stand-in through which several autograd functions send their gradient for one tensor in
  fp32; autograd sums them in fp32 and the tensor receives the sum rounded once.
"""

from __future__ import annotations

import torch


def _split(x: torch.Tensor, low: torch.dtype) -> list[torch.Tensor]:
    """x as [hi, lo] in dtype ``low`` with hi + lo = x to about twice ``low``'s mantissa (bf16: 16 bits);
    an x already in ``low`` is exact as it is."""
    if x.dtype == low:
        return [x]
    hi = x.to(low)
    return [hi, (x - hi.float()).to(low)]


def mm_f32(a: torch.Tensor, b: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """``a @ b`` as fp32, a and b each fp32 or ``low`` (the parameters' dtype), no operand rounded to ``low``.

    CPU: an fp32 product of the upcast inputs. CUDA with ``low`` bf16/fp16: tensor-core GEMMs with an fp32
    output (``torch.mm(..., out_dtype=float32)``): products of ``low`` values are exact, and an fp32 operand is
    split into hi + lo parts in ``low`` (2 GEMMs; 3 when both are fp32, dropping lo x lo), which carry 16
    bits (relative error ~2^-17, against 2^-9 for the operand rounded to bf16). With ``low`` fp32 it is the
    plain fp32 product (TF32 as the user configured it).
    """
    if low == torch.float32 or not a.is_cuda:
        return a.float() @ b.float()
    return addmm_f32_(torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32), a, b, low)


# addmm_f32_'s GEMM outputs on CUDA hold at most this many fp32 elements (16 MiB), so accumulating into a
# [Vd, H] gradient does not allocate a second one.
BLOCK_ELEMENTS = 2**22


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """``acc += a @ b`` in place, acc fp32, the product as ``mm_f32`` forms it; returns acc."""
    if low == torch.float32 or not a.is_cuda:
        return acc.addmm_(a.float(), b.float())
    return addmm_parts_(acc, a, b, low, lambda x, y: torch.mm(x, y, out_dtype=torch.float32))


def addmm_parts_(acc, a, b, low, mm_out_f32):
    """``acc += a @ b`` from GEMMs of ``low`` parts: ``mm_out_f32(x, y)`` multiplies two ``low`` matrices
    into fp32 (cuBLAS on CUDA; tests pass an emulation to check the splitting on CPU). Output rows go in
    blocks of at most BLOCK_ELEMENTS."""
    b_parts = _split(b, low)
    rows = max(1, BLOCK_ELEMENTS // max(1, b.shape[1]))
    for i in range(0, a.shape[0], rows):
        for j, pa in enumerate(_split(a[i:i + rows], low)):
            for k, pb in enumerate(b_parts):
                if j + k < 2:
                    acc[i:i + rows].add_(mm_out_f32(pa, pb))
    return acc


class _Fp32Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        # Values are never read: consumers compute with x itself. A zero-stride fp32 scalar costs no memory.
        return torch.zeros((), dtype=torch.float32, device=x.device).expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype)


def fp32_grad(x: torch.Tensor) -> torch.Tensor:
    """A zero-memory fp32 stand-in for ``x``'s gradient (shape of x, dtype fp32, values meaningless).

    Autograd functions that take it next to x (fused_loss.py's ``grad_into``) return their gradient for x
    there, in fp32; autograd sums every such contribution in fp32, and x receives the total rounded to its
    dtype once, instead of one rounded term per function.
    """
    return _Fp32Grad.apply(x)
