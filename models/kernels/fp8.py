"""fp8-e4m3 packing of feature vectors with one fp32 scale per token (row).

Scale = amax(|x|) / 448 (the largest finite e4m3 value), so every row uses the full fp8 range.
The torch path runs on CPU and is the oracle; on CUDA tensors (impl="auto") one Triton program per row
does the same math in two passes over H (amax, then scale + round), reading x once per pass.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_e4m3_grid(v):
    # RNE to the e4m3 grid in fp32: step = 2^(exponent - 3) (3 mantissa bits), 2^-9 below the smallest
    # normal 2^-6; adding and subtracting C = 2^23 * step leaves exactly the rounded value.
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    c = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    mag = (tl.abs(v) + c) - c
    return tl.where(v < 0, -mag, mag)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, H, BLOCK_H: tl.constexpr, EXACT_CAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_H,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # Correctly rounded divisions, so the codes match the torch path bit for bit.
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        if EXACT_CAST:  # the interpreter's fp32->fp8 cast drops the rounding carry (124.3 -> 64): pre-round
            q = _round_to_e4m3_grid(q)
        tl.store(q_ptr + row * H + cols, q.to(tl.float8e4nv), mask=cols < H)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        q = tl.load(q_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, (q * scale).to(out_ptr.dtype.element_ty), mask=cols < H)


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"fp8: impl={impl!r}; use 'auto', 'triton' or 'torch'")
    return impl == "triton" or (impl == "auto" and x.is_cuda)


def _block(h: int) -> int:
    return min(triton.next_power_of_2(h), 64 if INTERPRET else 4096)


def quantize_e4m3(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] float -> (q [..., H] float8_e4m3fn, scale [...] float32) with x ~= q * scale.

    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch", "auto" = triton on CUDA tensors.
    """
    if _use_triton(x, impl):
        h = x.shape[-1]
        x2 = x.reshape(-1, h).contiguous()
        q = torch.empty(x2.shape, device=x.device, dtype=torch.float8_e4m3fn)
        scale = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
        if x2.shape[0]:
            _quantize_kernel[(x2.shape[0],)](x2, q, scale, h, BLOCK_H=_block(h), EXACT_CAST=INTERPRET,
                                             num_warps=1 if INTERPRET else 4)
        return q.view(x.shape), scale.view(x.shape[:-1])
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)
    # Divided by a tensor, not a Python number: CUDA divides by a scalar as a product with its reciprocal, 1 ulp
    # off the kernel's correctly rounded quotient (the H200 lane, 2026-12-04); a tensor divisor rounds alike.
    scale = amax / amax.new_tensor(E4M3_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                    impl: str = "auto") -> torch.Tensor:
    """Inverse of quantize_e4m3 (up to e4m3 rounding: relative error <= 2**-4 per element)."""
    if _use_triton(q, impl):
        h = q.shape[-1]
        q2 = q.reshape(-1, h).contiguous()
        out = torch.empty(q2.shape, device=q.device, dtype=dtype)
        if q2.shape[0]:
            _dequantize_kernel[(q2.shape[0],)](q2, scale.reshape(-1).float().contiguous(), out, h,
                                               BLOCK_H=_block(h), num_warps=1 if INTERPRET else 4)
        return out.view(q.shape)
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
