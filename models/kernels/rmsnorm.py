"""RMSNorm with Triton forward and backward kernels (fp32 accumulation, input dtype in and out).

y = x * rsqrt(mean(x^2) + eps) * w over the last dim. Two implementations:
- "torch":  torch.nn.functional.rms_norm in the input dtype. On CUDA torch dispatches it to its own fused
            kernel (_fused_rms_norm: fp32 accumulation, saves only x and rstd for backward) when x and w
            share a dtype, so w is cast to x's dtype; on CPU it runs torch's composite (fp32 internally).
- "triton": the kernels below (CUDA, or CPU under TRITON_INTERPRET=1); saves x and rstd.
transformers' LlamaRMSNorm, by contrast, is six unfused ops that keep an fp32 copy of x and a normalised
x for backward (6 bytes per element with bf16 x; scripts/bench_rmsnorm.py measures all three).
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
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: N * H may pass 2**31
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
    off = g.to(tl.int64) * H  # int64 offsets: N * H may pass 2**31
    step = n_prog.to(tl.int64) * H
    for row in range(g, N, n_prog):
        x = tl.load(x_ptr + off + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        dyw = dy * w
        dx = rstd * (dyw - xhat * (tl.sum(dyw * xhat, axis=0) / H))
        tl.store(dx_ptr + off + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += dy * xhat
        off += step
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
        sms = 1 if INTERPRET else torch.cuda.get_device_properties(x2.device).multi_processor_count
        programs = max(1, min(n, 2 if INTERPRET else 4 * sms))
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, h, device=x2.device, dtype=torch.float32)
        _bwd_kernel[(programs,)](x2, weight.contiguous(), dy.reshape(n, h).contiguous(), rstd, dx, dw_part,
                                 n, h, **_launch_opts(h))
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


IMPLS = ("torch", "triton", "auto")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H]; returns x's dtype.

    impl: "torch" (F.rms_norm; torch's fused kernel on CUDA), "triton" (CUDA, or CPU under
    TRITON_INTERPRET=1), "auto" = triton on CUDA tensors, torch elsewhere. All accumulate in fp32 and
    differentiate in x and weight.
    """
    if impl not in IMPLS:
        raise ValueError(f"rms_norm: impl={impl!r}; use one of {IMPLS}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    if impl == "triton" and not (x.is_cuda or INTERPRET):
        raise ValueError("rms_norm: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
                         "use impl='torch' (drafter.norm_impl=torch)")
    if impl == "triton" or (impl == "auto" and x.is_cuda):
        return _TritonRMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, x.shape[-1:], weight.to(x.dtype), eps)


class RMSNorm(torch.nn.Module):
    """Drop-in for transformers' LlamaRMSNorm (same parameter `weight`, so the same state dict) with a
    selectable implementation; ``impl`` may be changed on the instance."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, impl: str = "torch"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"
