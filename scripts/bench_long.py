"""Benchmark one long-context TTT step (forward + backward of the TTT loss over one packed row of T tokens)
with and without sequence parallelism: peak memory per rank and tokens/s, sp = 1 against sp = N in the same
run, at every T.

Each (T, sp) runs in a fresh process group of sp processes (``torch.multiprocessing``; gloo on CPU, NCCL on
CUDA with sp GPUs), so every peak is its own. Memory: on CPU the rise of the process's peak RSS
(``ru_maxrss``) over the step, above what the model and the row already hold (the largest rank's); on CUDA
``max_memory_allocated`` above the memory allocated before the step; and, exactly and on both, the bytes
of the tensors autograd keeps for backward (``saved GiB``: storages counted once, weights excluded). Neither counts the
optimizer, the gradients' ZeRO buckets or the feature row itself (recipes/llama3/README.md adds them up). tokens/s = T /
the slowest rank's step time (a group works on one row); ``CPU s`` is the process time of all ranks together
(on a shared CPU the wall time is noisy, the work is not). The row is one document of T tokens (full causal
attention: the long-context worst case), every position counted.

Shapes: ``tiny`` (the tiny target's drafter: H 256, 4 / 2 heads, Vd 2048, K 3; the CPU default) and
``llama3-8b`` (H 4096, 32 / 8 heads, intermediate 14336, Vd 32000, V 128256, K 7, Llama-3.1 RoPE; the CUDA
default). Compute in fp32 on CPU, bf16 on CUDA (DeepSpeed's bf16 mode). sp = 1 imports no DeepSpeed.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_long.py                 # CPU: T 4K-32K, sp 1 and 2
    PYTHONPATH=. python scripts/bench_long.py --device cuda --seqs 8192 32768 65536 131072 --sp 1  # one GPU

(Installed Fledge, or ``PYTHONPATH=.`` from a checkout: a GPU box with torch and transformers only.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import time
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=4096, num_hidden_layers=8, draft_vocab_size=2048, steps=3,
                 rope={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, num_hidden_layers=32, draft_vocab_size=32000, steps=7,
                      rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def _machine(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} cores visible"


def _rank(rank: int, size: int, T: int, args, port: int, out) -> None:
    import torch

    from fledge.data.features.batch import FeatureBatch
    from fledge.models.drafter import Eagle3Drafter
    from fledge.models.eagle import EagleSpec
    from fledge.train.losses import SoftCrossEntropy

    torch.set_num_threads(max(1, args.threads // size))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape = dict(SHAPES[args.shape])
    steps = args.steps or shape.pop("steps")
    shape.pop("steps", None)
    rope, Vd = shape.pop("rope"), shape.pop("draft_vocab_size")
    H, L = shape["hidden_size"], shape["num_hidden_layers"]
    spec = EagleSpec(hidden_size=H, target_hidden_size=H, intermediate_size=shape["intermediate_size"],
                     num_attention_heads=shape["num_attention_heads"],
                     num_key_value_heads=shape["num_key_value_heads"], head_dim=H // shape["num_attention_heads"],
                     rms_norm_eps=1e-5, hidden_act="silu", vocab_size=shape["vocab_size"], draft_vocab_size=Vd,
                     aux_layer_ids=[2, L // 2, L - 3], target_num_hidden_layers=L,
                     max_position_embeddings=max(131072, T), rope=rope, fc_norm=True, norm_output=True,
                     norm_before_fc=False)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    drafter = Eagle3Drafter(spec, attention="auto").to(device, dtype)
    head = (torch.randn(Vd, H) * 0.02).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    batch = FeatureBatch(
        input_ids=torch.randint(0, shape["vocab_size"], (1, T), generator=g),
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        aux_hidden=torch.randn(1, T, 3 * H, generator=g), target_hidden=torch.randn(1, T, H, generator=g),
        target_argmax=torch.randint(0, Vd, (1, T), generator=g), position_ids=torch.arange(T)[None],
        document_ids=torch.zeros(1, T, dtype=torch.int32))
    loss = SoftCrossEntropy(steps=steps, step_weight=0.8, chunk_size=1024)
    shard = None
    if size > 1:
        import torch.distributed as dist

        from fledge.distributed import SequenceGroups
        from fledge.train.sequence_parallel import SequenceParallel, check_heads

        check_heads(size, spec.num_key_value_heads, spec.num_attention_heads)

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                          LOCAL_RANK=str(rank))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
        sp = SequenceParallel(SequenceGroups(size, rank, dist.group.WORLD, 0, 1), steps)
        shard = sp.split(batch).to(device, dtype)
        batch = shard.batch
    else:
        batch = batch.to(device, dtype)

    saved: dict[int, int] = {}  # storage -> bytes of every tensor autograd keeps for backward (exact, no RSS noise)

    def pack(t):
        if t.device.type != "meta":
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def step():
        drafter.zero_grad(set_to_none=True)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = loss(drafter, batch, head, shard=shard)
        res.loss.backward()
        if cuda:
            torch.cuda.synchronize()

    if cuda:  # compiles flex attention for this T's key lengths, and warms the allocator
        step()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = {p.untyped_storage().data_ptr() for p in drafter.parameters()} | {head.untyped_storage().data_ptr()}
    kept = sum(n for ptr, n in saved.items() if ptr not in params)  # activations, not the weights
    out.put({"rank": rank, "seconds": dt, "cpu_seconds": cpu, "step_bytes": peak - base, "total_bytes": peak,
             "saved_bytes": kept})
    if size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _spawned(rank, size, T, args, port, q):
    try:
        _rank(rank, size, T, args, port, q)
    except BaseException as e:  # an out-of-memory at this T: say so at once instead of leaving the parent waiting
        q.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        raise


def measure(T: int, size: int, args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_spawned, args=(r, size, T, args, port, q)) for r in range(size)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(size):
            results.append(q.get(timeout=args.timeout))
            if "error" in results[-1]:  # the other ranks may wait in a collective for ever
                break
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors or any(p.exitcode for p in procs):
        raise RuntimeError(f"T={T} sp={size}: {errors[0] if errors else [p.exitcode for p in procs]}")
    sec = max(r["seconds"] for r in results)
    return {"T": T, "sp": size, "seconds": sec, "tokens_per_s": T / sec,
            "cpu_seconds_all_ranks": sum(r["cpu_seconds"] for r in results),
            "step_gib_per_rank": max(r["step_bytes"] for r in results) / 2**30,
            "total_gib_per_rank": max(r["total_bytes"] for r in results) / 2**30,
            "saved_gib_per_rank": max(r["saved_bytes"] for r in results) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="drafter shape (default: tiny on CPU, llama3-8b on CUDA)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--sp", type=int, nargs="+", default=None, help="sequence-parallel sizes (default: 1 2 on "
                    "CPU; 1 and the GPU count on CUDA)")
    ap.add_argument("--steps", type=int, default=0, help="TTT steps K (default: the shape's)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)),
                    help="CPU threads in all (each of sp ranks gets threads / sp)")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="memory budget for the largest-T estimate")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    args.shape = args.shape or ("llama3-8b" if args.device == "cuda" else "tiny")
    if args.sp is None:
        import torch

        args.sp = [1, 2] if args.device == "cpu" else sorted({1, torch.cuda.device_count()})
    print(f"machine: {_machine(args.device)}; shape {args.shape}, K={args.steps or SHAPES[args.shape]['steps']}, "
          f"{'bf16' if args.device == 'cuda' else 'fp32'}, {args.threads} threads", flush=True)
    rows = []
    print(f"{'T':>7} {'sp':>3} {'s/step':>8} {'tok/s':>8} {'CPU s':>8} {'step GiB/rank':>14} {'x sp=1 mem':>11} "
          f"{'x sp=1 tok/s':>13} {'saved GiB/rank':>15} {'x sp=1':>7}")
    for T in args.seqs:
        base = None
        for size in args.sp:
            try:
                r = measure(T, size, args)
            except Exception as e:  # an OOM at one T does not hide the others
                print(f"{T:>7} {size:>3}  failed: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            base = base or (r if size == 1 else None)
            mem_x = r["step_gib_per_rank"] / base["step_gib_per_rank"] if base else float("nan")
            tok_x = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            rows.append({**r, "mem_vs_sp1": mem_x, "tokens_per_s_vs_sp1": tok_x})
            print(f"{T:>7} {size:>3} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} {r['cpu_seconds_all_ranks']:>8.1f} "
                  f"{r['step_gib_per_rank']:>14.3f} "
                  f"{mem_x:>11.2f} {tok_x:>13.2f} {r['saved_gib_per_rank']:>15.3f} "
                  f"{r['saved_gib_per_rank'] / base['saved_gib_per_rank'] if base else float('nan'):>7.2f}", flush=True)
    for size in args.sp:  # memory is linear in T: the per-token slope of the two largest T that ran
        pts = sorted((r["T"], r["step_gib_per_rank"]) for r in rows if r["sp"] == size)
        if len(pts) >= 2:
            (t1, m1), (t2, m2) = pts[-2], pts[-1]
            slope = (m2 - m1) / (t2 - t1)
            fit = int(t2 + (args.budget_gib - m2) / slope) if slope > 0 else None
            print(f"sp={size}: {slope * 2**30 / 1024:.1f} KiB per token of the row per rank (T {t1}->{t2}); the step "
                  f"fits {args.budget_gib:g} GiB per rank up to T ~ {fit:,} (linear extrapolation)")
    if args.json:
        report = {"machine": _machine(args.device), "shape": args.shape, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
