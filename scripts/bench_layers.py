"""Benchmark one TTT training step (K steps, forward + backward with the ttt_ce loss) per drafter layer kind.

Per kind (models/layers/: llama, qwen3, mla): tokens/s and peak memory at T = 2048, K = 7, each as a
ratio to the Llama layer measured in the same run. The drafter is the scaled-down Llama-3-8B shape of
scripts/bench_drafter.py: H = 1024, 8 heads / 2 kv heads of 128, intermediate 3584, 3 aux states,
Vd = 8000, V = 16000. The MLA layer takes the widths a Llama target implies (models/layers/mla.py MLA_DEFAULTS,
DeepSeek-V3's: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128).

- ``--device cpu``: fp32, the memory-linear attention path (``sdpa``); each kind runs in a fresh
  subprocess so its peak RSS is its own, and "activations" subtracts a subprocess that builds the same
  model and batch without stepping.
- ``--device cuda``: bf16 weights, the flex path (compiled flex_attention with the TTT block mask; the
  script checks that the drafter resolved to flex), one warm-up step (compilation) before the timed ones;
  peak memory is ``torch.cuda.max_memory_allocated`` during the timed steps, minus what was allocated
  before them.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_layers.py [--seq 2048] [--steps 7] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=16000, num_hidden_layers=32, max_position_embeddings=131072, rms_norm_eps=1e-5)
VD = 8000
KINDS = ("llama", "qwen3", "mla")


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} (CUDA), torch {torch.__version__}"
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def _one(kind: str, T: int, steps: int, iters: int, device: str, run: bool) -> dict:
    import torch
    from transformers import LlamaConfig

    from fledge.conf.schema import DrafterConfig
    from fledge.data.features.batch import FeatureBatch
    from fledge.models.algorithms import DrafterSpec
    from fledge.models.attention import resolve_attention
    from fledge.models.drafter import Eagle3Drafter
    from fledge.train.losses import ttt_loss

    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).to_dict()
    spec = DrafterSpec.from_target_config(cfg, DrafterConfig(draft_vocab_size=VD, layer=kind), [2, 16, 29])
    d = Eagle3Drafter(spec, attention="auto").to(dev)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d = d.to(dtype)
    impl = resolve_attention(d.attention, dev)
    assert impl == ("flex" if device == "cuda" else "sdpa"), impl
    H = SHAPE["hidden_size"]
    half = T // 2  # two packed documents
    batch = FeatureBatch(
        input_ids=torch.randint(0, SHAPE["vocab_size"], (1, T)),
        loss_mask=torch.rand(1, T) > 0.3,
        aux_hidden=torch.randn(1, T, 3 * H).to(dtype),
        target_hidden=torch.randn(1, T, H).to(dtype),
        target_argmax=torch.randint(0, VD, (1, T)),
        position_ids=torch.cat([torch.arange(half), torch.arange(T - half)])[None],
        document_ids=torch.cat([torch.zeros(half), torch.ones(T - half)]).int()[None],
    )
    batch = FeatureBatch(**{k: v.to(dev) for k, v in vars(batch).items()})
    head = (torch.randn(VD, H) * 0.02).to(dev, dtype)
    params = sum(p.numel() for n, p in d.named_parameters() if p.requires_grad)

    def step():
        res = ttt_loss(d, batch, head, steps=steps, step_weight=0.8, chunk_size=1024)
        res.loss.backward()
        d.zero_grad(set_to_none=True)

    times, peak = [], 0.0
    if run:
        if device == "cuda":
            step()  # compile flex for every key length (K of them) and warm the allocator
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    if device == "cpu":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    dims = {k: getattr(spec, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim")} if kind == "mla" else {}
    return {"kind": kind, "T": T, "impl": impl, "s": min(times) if times else 0.0, "peak_mib": peak,
            "trainable_params": params, "dims": dims}


def _run(kind: str, args, run: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--one", kind, "--seq", str(args.seq), "--steps", str(args.steps),
           "--iters", str(args.iters), "--device", args.device]
    if not run:
        cmd.append("--no-run")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"kind": kind, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--one")
    ap.add_argument("--no-run", action="store_true")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.seq, args.steps, args.iters, args.device, not args.no_run)))
        return
    base = _run("llama", args, run=False)["peak_mib"] if args.device == "cpu" else 0.0
    rows = []
    for kind in args.kinds:
        r = _run(kind, args)
        if "error" not in r and args.device == "cpu":
            r["act_mib"] = r["peak_mib"] - base
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\n{machine(args.device)}; T={args.seq}, K={args.steps}, "
          f"{'bf16, flex' if args.device == 'cuda' else 'fp32, memory-linear sdpa'}; H=1024 heads 8/2x128 "
          f"I=3584 Vd={VD} V=16000, 1 row of 2 documents; best of {args.iters}\n")
    mem = "peak MiB (CUDA, above the model)" if args.device == "cuda" else "peak RSS MiB | activations MiB"
    print(f"| layer | attention | trainable params | tokens/s | {mem} | tok/s vs llama | memory vs llama |")
    print("|---|---|---|---|---|---|---|" + ("" if args.device == "cuda" else "---|"))
    ref = next((r for r in rows if r.get("kind") == "llama" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | - | - | - | - | {r['error']} |")
            continue
        tps = r["T"] / r["s"]
        key = "act_mib" if args.device == "cpu" else "peak_mib"
        m = f"{r['peak_mib']:.0f} | {r['act_mib']:.0f}" if args.device == "cpu" else f"{r['peak_mib']:.0f}"
        ratio = f"{tps / (ref['T'] / ref['s']):.2f}x | {r[key] / max(ref[key], 1):.2f}x" if ref else "- | -"
        dims = f" {r['dims']}" if r["dims"] else ""
        print(f"| {r['kind']}{dims} | {r['impl']} | {r['trainable_params'] / 1e6:.1f}M | {tps:.0f} | {m} | {ratio} |")


if __name__ == "__main__":
    main()
