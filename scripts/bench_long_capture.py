"""Benchmark: capturing one long row in pieces through the target's KV cache (capture.chunk_tokens) vs one
forward, on a random Llama: extra peak memory (RSS above the loaded model) and tokens/s, per row length T
and attention implementation, each configuration in a fresh process so peaks do not mix.

    python scripts/bench_long_capture.py [--lengths 2048 4096 8192] [--chunk 1024] [--attn eager sdpa]

Prints one table; ratios are chunked / one forward for the same T and attention, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _child(T: int, chunk: int, attn: str, layers: int, hidden: int, vocab: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fledge.models.target import FrozenTarget

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      vocab_size=vocab, max_position_embeddings=max(T, 4096))
    cfg._attn_implementation = attn
    target = FrozenTarget(LlamaForCausalLM(cfg).eval(), [1, layers // 2, layers - 1])
    x = torch.randint(0, vocab, (1, T))
    target.capture(x[:, :64])  # warm up, then the baseline peak
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    target.capture(x, chunk_tokens=chunk)
    sec = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": sec, "extra_peak_mib": (peak - base) / 1024, "tokens_per_s": T / sec}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--attn", nargs="+", default=["eager", "sdpa"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        T, chunk, attn = json.loads(args.child)
        print(json.dumps(_child(T, chunk, attn, args.layers, args.hidden, args.vocab)))
        return 0
    from fledge.models.precision import describe_cpu

    print(f"machine: {describe_cpu()}, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}; random Llama "
          f"L={args.layers} H={args.hidden} V={args.vocab}, fp32, one row; chunk {args.chunk}")
    print("| attention | T | one forward: extra peak MiB | tokens/s | chunked: extra peak MiB | tokens/s | "
          "peak ratio | speed ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for attn in args.attn:
        for T in args.lengths:
            res = []
            for chunk in (0, args.chunk):
                cmd = [sys.executable, __file__, "--child", json.dumps([T, chunk, attn]), "--layers", str(args.layers),
                       "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                res.append(json.loads(out))
            one, ch = res
            print(f"| {attn} | {T} | {one['extra_peak_mib']:.0f} | {one['tokens_per_s']:.0f} | "
                  f"{ch['extra_peak_mib']:.0f} | {ch['tokens_per_s']:.0f} | "
                  f"{ch['extra_peak_mib'] / max(one['extra_peak_mib'], 1e-9):.2f}x | "
                  f"{ch['tokens_per_s'] / one['tokens_per_s']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
