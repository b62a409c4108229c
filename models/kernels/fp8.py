"""fp8-e4m3 packing of feature vectors with one fp32 scale per token (row).

Scale = amax(|x|) / 448 (the largest finite e4m3 value), so every row uses the full fp8 range.
This file holds the torch path (CPU and fallback); a Triton kernel may dispatch on CUDA tensors.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] float -> (q [..., H] float8_e4m3fn, scale [...] float32) with x ~= q * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_e4m3 (up to e4m3 rounding: relative error <= 2**-4 per element)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
