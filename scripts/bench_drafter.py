"""Benchmark the TTT forward+backward: memory-linear attention (``sdpa``) vs the dense-mask reference.

A Llama-3-8B-shaped drafter scaled down for a small CPU: H = 1024, 8 heads / 2 kv heads (head_dim 128,
GQA 4 like Llama-3-8B's 32/8), intermediate 3584 (the 8B's 3.5x), 3 aux states, Vd = 8000, V = 16000,
K = 7 steps, fp32. Each (path, T) runs in a fresh subprocess so its peak RSS (``ru_maxrss``) is its own;
``act MiB`` subtracts the peak of a subprocess that only builds the model and batch. Dense runs whose
attention scores alone would exceed ``--dense-budget-gb`` are skipped (they grow as T^2 * K^2).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_drafter.py [--seqs 512 2048 4096 8192] [--steps 7]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=16000, num_hidden_layers=32, max_position_embeddings=131072, rms_norm_eps=1e-5)
VD = 8000


def _one(impl: str, T: int, steps: int, iters: int) -> dict:
    import torch
    from transformers import LlamaConfig

    from fledge.conf.schema import DrafterConfig
    from fledge.data.features.batch import FeatureBatch
    from fledge.models.algorithms import DrafterSpec
    from fledge.models.drafter import Eagle3Drafter
    from fledge.train.losses import ttt_loss

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    spec = DrafterSpec.from_target_config(cfg, DrafterConfig(draft_vocab_size=VD), [2, 16, 29])
    d = Eagle3Drafter(spec, attention=impl if impl != "none" else "sdpa")
    H = SHAPE["hidden_size"]
    half = T // 2  # two packed documents
    batch = FeatureBatch(
        input_ids=torch.randint(0, SHAPE["vocab_size"], (1, T)),
        loss_mask=torch.rand(1, T) > 0.3,
        aux_hidden=torch.randn(1, T, 3 * H),
        target_hidden=torch.randn(1, T, H),
        target_argmax=torch.randint(0, VD, (1, T)),
        position_ids=torch.cat([torch.arange(half), torch.arange(T - half)])[None],
        document_ids=torch.cat([torch.zeros(half), torch.ones(T - half)]).int()[None],
    )
    head = torch.randn(VD, H) * 0.02
    times = []
    if impl != "none":
        for _ in range(iters):
            t0 = time.perf_counter()
            res = ttt_loss(d, batch, head, steps=steps, step_weight=0.8, chunk_size=1024)
            res.loss.backward()
            times.append(time.perf_counter() - t0)
            d.zero_grad(set_to_none=True)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"impl": impl, "T": T, "s": min(times) if times else 0.0, "rss_mib": rss_mib}


def _run(impl: str, T: int, steps: int, iters: int) -> dict:
    cmd = [sys.executable, __file__, "--one", impl, str(T), "--steps", str(steps), "--iters", str(iters)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"impl": impl, "T": T, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:80]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--dense-budget-gb", type=float, default=4.0)
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "T"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], int(args.one[1]), args.steps, args.iters)))
        return
    rows = []
    for T in args.seqs:
        base = _run("none", T, args.steps, args.iters)["rss_mib"]
        for impl in ("sdpa", "dense"):
            # dense saves fp32 probabilities [heads, T, (k+1) T] for every step k
            dense_gb = 4 * SHAPE["num_attention_heads"] * T * T * sum(range(1, args.steps + 1)) / 2**30
            if impl == "dense" and dense_gb > args.dense_budget_gb:
                rows.append({"impl": impl, "T": T, "error": f"skipped: scores alone ~{dense_gb:.0f} GiB"})
                continue
            r = _run(impl, T, args.steps, args.iters)
            r["act_mib"] = r.get("rss_mib", base) - base
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\nK={args.steps}, fp32, H=1024 heads 8/2 head_dim 128 I=3584 Vd={VD} V=16000, batch 1 row of 2 documents\n")
    print("| T | path | tokens/s | peak RSS MiB | activations MiB | tok/s vs dense |")
    print("|---|---|---|---|---|---|")
    by = {(r["impl"], r["T"]): r for r in rows}
    for r in rows:
        if "error" in r:
            print(f"| {r['T']} | {r['impl']} | - | - | - | {r['error']} |")
            continue
        tps = r["T"] / r["s"]
        dense = by.get(("dense", r["T"]), {})
        ratio = f"{tps / (r['T'] / dense['s']):.2f}x" if "s" in dense else "-"
        print(f"| {r['T']} | {r['impl']} | {tps:.0f} | {r['rss_mib']:.0f} | {r['act_mib']:.0f} | {ratio} |")
    lin = {r["T"]: r for r in rows if r["impl"] == "sdpa" and "act_mib" in r}
    if 4096 in lin and 8192 in lin:
        print(f"\nmemory-linear peak RSS T=8192 / T=4096: {lin[8192]['rss_mib'] / lin[4096]['rss_mib']:.2f}x "
              f"(activations {lin[8192]['act_mib'] / max(lin[4096]['act_mib'], 1):.2f}x); goal <= 2.4x")


if __name__ == "__main__":
    main()
