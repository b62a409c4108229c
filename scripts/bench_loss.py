"""Peak memory and time of the TTT loss (forward + backward over K steps), as train/losses computes it.

As in training, step k scores drafter state y_k [N, H] row t against teacher row t+1+k of one target
state t [N + K, Ht], so the K steps share teacher rows; the lm_heads W_d [Vd, H] (trainable) and W_t
[Vd, Ht] (frozen) are shared; the total is sum_k 0.8^k L_k / N, then one backward. Implementations:
- shared-triton / shared-chunked: train/losses' path (teacher expectation once per batch, then the
  drafter logsumexp per step: Triton kernel / torch chunks);
- fp32-head: its path outside ZeRO-3 for every loss without a rewrite of its own (models/kernels/head_loss.py:
  fp32 logits, the teacher's computed once per chunk of teacher rows for all steps, recomputed in backward);
- fp32-head-per-step: the same, one step at a time (the teacher's logits computed K times): what sharing saves;
- per-step: its ZeRO-3 path, the earlier design (teacher recomputed in every step, chunks checkpointed);
- naive: materialised [N, Vd] logits per step, plain autograd (the memory baseline).
``--loss`` picks the loss (default ttt_ce; the shared-* rows are the soft CE's own and run only for it; mix is
{ttt_ce: 0.5, tv: 0.5}).
"extra peak" is the peak memory above what the inputs already hold, so it is the loss's own cost.

GPU (the issue's shapes):  python scripts/bench_loss.py --device cuda
CPU (torch paths, reduced): python scripts/bench_loss.py --device cpu --h 512 --vd 8000 --n 512 2048
Another loss:               python scripts/bench_loss.py --device cpu --h 512 --vd 8000 --n 2048 --loss tv
On CPU every measurement runs in a fresh subprocess and the peak is the growth of the process's max RSS.
Prints a markdown table; ratios are against the per-step path measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from fledge.models.alignment import StepRows
from fledge.train.losses import LOSSES, Mix
from fledge.train.losses.paths import fp32_head_steps, per_step_module_calls, shared_teacher_steps

IMPLS = ("shared-triton", "shared-chunked", "fp32-head", "fp32-head-per-step", "per-step", "naive")


def _loss_sum(name, k, chunk_size):
    if name == "mix":
        return Mix(weights={"ttt_ce": 0.5, "tv": 0.5}, steps=k, step_weight=0.8, chunk_size=chunk_size).loss_sum
    return LOSSES.get(name)(steps=k, step_weight=0.8, chunk_size=chunk_size).loss_sum


def _make_inputs(n, h, ht, vd, k, device, dtype):
    """K drafter states (rows 0..N-1 of a [N + K + 1] layout), one teacher state, the heads, the masks."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = n + k + 1
    ys = [torch.randn(rows, h, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(k)]
    t = torch.randn(rows, ht, device=device, dtype=dtype, generator=g)
    head = torch.nn.Linear(h, vd, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vd, h, device=device, dtype=dtype, generator=g) * h**-0.5)
    w_t = torch.randn(vd, ht, device=device, dtype=dtype, generator=g) * ht**-0.5
    counted = [torch.arange(rows, device=device) < n for _ in range(k)]  # row t + 1 + k stays in range
    return ys, t, head, w_t, counted


def _step(impl, ys, t, head, w_t, counted, chunk_size, loss="ttt_ce"):
    loss_sum = _loss_sum(loss, len(ys), chunk_size)
    if impl == "naive":
        n = int(counted[0].sum())
        parts = [loss_sum(head(y[:n]).float(), (t[1 + k:1 + k + n] @ w_t.T).float()) for k, y in enumerate(ys)]
    else:
        # train/losses' execution paths take per-step StepRows: step k scores row r against teacher row r+1+k.
        rows = [StepRows(lead=1 + k, teacher_argmax=torch.zeros_like(c, dtype=torch.long), counted=c, scored=c)
                for k, c in enumerate(counted)]
        if impl == "per-step":
            scored = per_step_module_calls(loss_sum, ys, rows, t, head, w_t, chunk_size)
        elif impl == "fp32-head":
            scored = fp32_head_steps(loss_sum, ys, rows, t, head, w_t, chunk_size)
        elif impl == "fp32-head-per-step":
            scored = [fp32_head_steps(loss_sum, [y], [r], t, head, w_t, chunk_size)[0] for y, r in zip(ys, rows)]
        else:
            scored = shared_teacher_steps(ys, rows, t, head, w_t, impl.removeprefix("shared-"), chunk_size)
        parts = [p for p, _, _ in scored]
    total = sum(0.8**k * p / int(c.sum()) for k, (p, c) in enumerate(zip(parts, counted)))
    total.backward()
    for x in ys + [head.weight]:
        x.grad = None
    return float(total)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(impl, n, args) -> dict:
    """One (impl, N) point in this process: {'ms': median wall time, 'peak_mib': extra peak memory}."""
    device, dtype = args.device, getattr(torch, args.dtype)
    inputs = _make_inputs(n, args.h, args.ht or args.h, args.vd, args.k, device, dtype)
    try:
        if device == "cuda":
            _step(impl, *inputs, args.chunk_size, args.loss)  # warm-up: Triton compiles, cuBLAS picks algorithms
            _sync(device)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:  # the warm-up's peak counts: it is the same as a timed step's
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            _step(impl, *inputs, args.chunk_size, args.loss)
        times = []
        for _ in range(args.reps):
            _sync(device)
            start = time.perf_counter()
            _step(impl, *inputs, args.chunk_size, args.loss)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        if device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**10  # KiB on Linux
        return {"ms": statistics.median(times), "peak_mib": peak}
    except torch.OutOfMemoryError:
        return {"ms": None, "peak_mib": None, "oom": True}


def _measure_in_subprocess(impl, n, argv) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--one", impl, str(n)],
                         capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        return {"ms": None, "peak_mib": None, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(x, unit):
    return "-" if x is None else f"{x:,.0f} {unit}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, nargs="+", default=[2048, 8192, 32768], help="rows per step (tokens)")
    p.add_argument("--h", type=int, default=4096, help="drafter hidden size")
    p.add_argument("--ht", type=int, default=0, help="target hidden size (default: --h)")
    p.add_argument("--vd", type=int, default=32000, help="draft vocab size")
    p.add_argument("--k", type=int, default=7, help="TTT steps")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--chunk-size", type=int, default=1024, help="row chunk of the chunked torch path")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--loss", default="ttt_ce", choices=sorted(LOSSES), help="the loss (mix: ttt_ce 0.5 + tv 0.5)")
    p.add_argument("--impls", nargs="+", default=None, choices=IMPLS, help="default: all on cuda, all but "
                   "shared-triton on cpu")
    p.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args)))
        return
    impls = args.impls or [i for i in IMPLS if (args.device == "cuda" or i != "shared-triton")
                           and (args.loss == "ttt_ce" or not i.startswith("shared"))]
    if args.loss != "ttt_ce" and any(i.startswith("shared") for i in impls):
        p.error(f"--impls shared-*: the soft CE's own path; --loss {args.loss} has none")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    ht = args.ht or args.h
    print(f"loss={args.loss}, K={args.k}, H={args.h}, Ht={ht}, Vd={args.vd}, {args.dtype}, device={args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), chunk_size={args.chunk_size}, "
          f"median of {args.reps}; extra peak = memory above the inputs during forward+backward\n")
    print("| N | impl | time | extra peak | speed-up vs per-step | peak vs per-step |")
    print("|---|---|---|---|---|---|")
    for n in args.n:
        rows = {}
        for impl in impls:
            if args.device == "cuda":
                rows[impl] = measure(impl, n, args)
                torch.cuda.empty_cache()
            else:
                rows[impl] = _measure_in_subprocess(impl, n, passthrough)
        ref = rows.get("per-step", {})
        for impl, r in rows.items():
            note = " (OOM)" if r.get("oom") else (f" (error: {r['error']})" if r.get("error") else "")
            t_ratio = f"{ref['ms'] / r['ms']:.2f}x" if r["ms"] and ref.get("ms") else "-"
            m_ratio = f"{r['peak_mib'] / ref['peak_mib']:.2f}x" if r["peak_mib"] and ref.get("peak_mib") else "-"
            print(f"| {n} | {impl}{note} | {_fmt(r['ms'], 'ms')} | {_fmt(r['peak_mib'], 'MiB')} | {t_ratio} | "
                  f"{m_ratio} |", flush=True)


if __name__ == "__main__":
    main()
