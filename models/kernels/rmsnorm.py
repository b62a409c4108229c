"""RMSNorm with Triton forward and backward kernels (fp32 accumulation, input dtype in and out).

y = x * rsqrt(mean(x^2) + eps) * w over the last dim. The torch path (torch.nn.functional.rms_norm) runs
on CPU and is the oracle; `rms_norm(..., impl="auto")` picks the kernel for CUDA tensors.
Backward, with xhat = x * rstd:  dx = rstd * (dy*w - xhat * mean(dy*w*xhat)),  dw = sum_rows dy * xhat.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * H + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, N, H, BLOCK_H: tl.constexpr):
    # Program g handles rows g, g + G, ... and writes its partial dw to dw_part[g]; torch sums the G rows.
    g = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_H,), tl.float32)
    for row in range(g, N, n_prog):
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        dyw = dy * w
        dx = rstd * (dyw - xhat * (tl.sum(dyw * xhat, axis=0) / H))
        tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += dy * xhat
    tl.store(dw_part_ptr + g * H + cols, dw, mask=ok)


def _launch_opts(h: int) -> dict:
    block = triton.next_power_of_2(h)
    return dict(BLOCK_H=block, num_warps=1 if INTERPRET else min(max(block // 256, 1), 16))


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n, h = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n, device=x.device, dtype=torch.float32)
        _fwd_kernel[(n,)](x2, weight.contiguous(), y, rstd, h, eps, **_launch_opts(h))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n, h = x2.shape
        programs = max(1, min(n, 2 if INTERPRET else 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count))
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, h, device=x2.device, dtype=torch.float32)
        _bwd_kernel[(programs,)](x2, weight.contiguous(), dy.reshape(n, h).contiguous(), rstd, dx, dw_part,
                                 n, h, **_launch_opts(h))
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H]; returns x's dtype.

    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (F.rms_norm), "auto" = triton on
    CUDA tensors, torch elsewhere. Both compute in fp32 and differentiate in x and weight.
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"rms_norm: impl={impl!r}; use 'auto', 'triton' or 'torch'")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    if impl == "triton" or (impl == "auto" and x.is_cuda):
        return _TritonRMSNorm.apply(x, weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Drop-in RMSNorm (parameter `weight`, like transformers' LlamaRMSNorm) dispatching to the kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, impl: str = "auto"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"
