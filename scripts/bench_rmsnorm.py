"""RMSNorm forward+backward: transformers' LlamaRMSNorm (the baseline) vs F.rms_norm ("torch") vs ours ("triton").

Two figures per implementation:
- saved bytes/element: what autograd keeps for backward beyond the input x and the weight, per element
  of x. This is accounting, not timing, so it is measured the same on any device; the Triton kernel is
  measured under TRITON_INTERPRET=1 in a subprocess when there is no GPU. (On CPU "torch" runs torch's
  composite; on CUDA torch dispatches it to its fused kernel, which saves only rstd, as ours does.)
- time and peak memory of forward+backward at the given shape (CUDA: all three; CPU: the torch paths).
Ratios are against LlamaRMSNorm measured in the same run.

    python scripts/bench_rmsnorm.py --device cuda                       # N 8192 32768, H 4096, bf16
    python scripts/bench_rmsnorm.py --device cpu --n 8192 --h 1024      # torch paths on CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fledge.models.kernels.rmsnorm import RMSNorm

ROOT = Path(__file__).resolve().parents[1]

IMPLS = ("hf", "torch", "triton")


def make_norm(impl: str, h: int, device, dtype) -> torch.nn.Module:
    if impl == "hf":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm = LlamaRMSNorm(h, eps=1e-5)
    else:
        norm = RMSNorm(h, eps=1e-5, impl=impl)
    return norm.to(device=device, dtype=dtype)


def saved_bytes_per_element(impl: str, n: int, h: int, device, dtype) -> float:
    """Bytes autograd saves for backward, beyond x's and the weight's own storage, per element of x."""
    norm = make_norm(impl, h, device, dtype)
    x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    own = {x.untyped_storage().data_ptr(), norm.weight.untyped_storage().data_ptr()}
    return sum(b for ptr, b in storages.items() if ptr not in own) / x.numel()


def time_and_peak(impl: str, n: int, h: int, device, dtype, reps: int) -> dict:
    norm = make_norm(impl, h, device, dtype)
    x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        norm(x).backward(dy)
        x.grad = norm.weight.grad = None

    step()  # warm-up (Triton compiles)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    peak = None
    if device == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {"ms": statistics.median(times), "peak_mib": peak}


def _triton_saved_under_interpreter(h: int, dtype: str) -> float:
    code = (f"import runpy, torch; "
            f"f = runpy.run_path({__file__!r})['saved_bytes_per_element']; "
            f"print(f('triton', 64, {h}, 'cpu', torch.{dtype}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, nargs="+", default=[8192, 32768], help="rows (tokens)")
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    impls = IMPLS if args.device == "cuda" else ("hf", "torch")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"H={args.h}, {args.dtype}, device={args.device} ({name}), median of {args.reps}\n")
    print("| impl | saved for backward, bytes per element of x (beyond x and w) | where measured |")
    print("|---|---|---|")
    for impl in IMPLS:
        if impl == "triton" and args.device != "cuda":
            saved, where = _triton_saved_under_interpreter(args.h, args.dtype), "CPU, TRITON_INTERPRET=1"
        else:
            saved, where = saved_bytes_per_element(impl, 64, args.h, args.device, dtype), args.device
        print(f"| {impl} | {saved:.2f} | {where} |", flush=True)
    print("\n| N | impl | fwd+bwd | speed-up vs hf | peak (CUDA) | peak vs hf |")
    print("|---|---|---|---|---|---|")
    for n in args.n:
        rows = {impl: time_and_peak(impl, n, args.h, args.device, dtype, args.reps) for impl in impls}
        ref = rows["hf"]
        for impl, r in rows.items():
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f} MiB"
            ratio = "-" if r["peak_mib"] is None else f"{r['peak_mib'] / ref['peak_mib']:.2f}x"
            print(f"| {n} | {impl} | {r['ms']:.2f} ms | {ref['ms'] / r['ms']:.2f}x | {peak} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
