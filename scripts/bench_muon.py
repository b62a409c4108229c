"""What a Muon step costs beside AdamW's on a drafter's matrices, and in which dtype its Newton-Schulz iteration
should run on this machine (train/optimizers.py ``ns_dtype``): times one optimizer step of ``MuonAdamW`` with the
iteration in bf16 (torch.optim.Muon's choice) and in fp32, and AdamW's step, over an EAGLE-3.1 drafter's trainable
parameters at a given hidden size (SmolLM2-135M's drafter by default: hidden 576, intermediate 1536, 9 heads of 64,
3 KV heads, draft vocab 8,192), all in the same run, one torch thread unless told.

    python scripts/bench_muon.py                          # SmolLM2's drafter shapes
    python scripts/bench_muon.py --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 32000
"""

from __future__ import annotations

import argparse
import time
from datetime import date

import torch
from torch import nn

from fledge.models.precision import describe_cpu
from fledge.train import optimizers


def drafter_like(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> nn.Module:
    """The trainable matrices of a one-layer EAGLE-3.1 drafter (fc over three states, attention, MLP, head) and a
    norm: the shapes Muon and AdamW step, without the model around them."""
    head_dim = hidden // heads
    shapes = {"fc": (hidden, 3 * hidden), "q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate), "lm_head": (vocab, hidden)}
    m = nn.Module()
    for name, (out, inp) in shapes.items():
        setattr(m, name, nn.Linear(inp, out, bias=False))
    m.norm = nn.LayerNorm(hidden)
    return m


def time_step(opt: torch.optim.Optimizer, model: nn.Module, repeats: int) -> float:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # the state is made on the first step
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = drafter_like(a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab)
    muon, rest = optimizers.muon_split(model)
    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0}
    rows = {"AdamW": time_step(torch.optim.AdamW(model.parameters(), **kw), model, a.repeats)}
    default = optimizers.ns_dtype
    try:
        for dtype in (torch.bfloat16, torch.float32):
            optimizers.ns_dtype = lambda device, dtype=dtype: dtype
            opt = optimizers.MuonAdamW(muon, rest, muon_lr=1e-3, momentum=0.95, muon_weight_decay=0.1, **kw)
            rows[f"Muon, Newton-Schulz in {str(dtype).removeprefix('torch.')}"] = time_step(opt, model, a.repeats)
    finally:
        optimizers.ns_dtype = default
    print(f"{describe_cpu()}, {a.threads} thread(s), {date.today()}; hidden {a.hidden}, "
          f"{len(muon)} Muon matrices ({sum(p.numel() for p in muon):,} parameters)")
    print(f"| optimizer step | seconds (best of {a.repeats}) | x AdamW |\n|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:.3f} | {s / rows['AdamW']:.1f} |")
    print(f"this machine's default (train/optimizers.py ns_dtype): {default(torch.device('cpu'))} on the CPU")


if __name__ == "__main__":
    main()
