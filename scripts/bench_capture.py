"""Capture throughput against the target's plain forward, and bytes per token against the 8 x H baseline.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_capture.py [--target DIR] [--samples 64] [--repeats 2]

Without --target a random Llama (--hidden/--layers/--vocab) is built in a temp dir. Both paths run the
same batches (plan_batches over the same samples). "forward" is the HF CausalLM forward (logits for every
position, no cache): the floor that capture cannot beat. "capture" is the whole offline stage for one rank:
hooks, chunked argmax, fp8 quantisation when asked, safetensors shards, checksums, index and manifest.
The baseline store is what public trainers write: one file per sample holding the 3 aux states and the
final state in bf16 (8 x H bytes per token), here measured by writing it the same way (safetensors).
Prints a markdown table; every figure is the best of --repeats round-robin runs in this process.

With ``--engine vllm`` (docs/serving.md; needs .engine/venv or --engine-python) the same samples are also
captured through vLLM (capture.engine=vllm: extract_hidden_states + the hidden-states connector, the
final norm and argmax made by Fledge, the same store), and vLLM runs the same prompts prefill-only with no
extraction at all: vLLM's own prefill speed, the floor the vLLM capture cannot beat. Each vLLM figure is
one run (an engine start-up each, excluded from the times); the vLLM store's bytes/token are counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

from fledge.conf.schema import Config
from fledge.data.capture.offline import (
    capture_rows,
    capture_split,
    dataset_lengths,
    pad_batch,
    plan_batches,
    store_meta,
)
from fledge.distributed import World
from fledge.models.target import FrozenTarget


def build_target(args, root: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 256),
                      vocab_size=args.vocab, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "target")
    return str(root / "target")


def build_data(path: Path, n: int, vocab: int, lo: int, hi: int) -> None:
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    Dataset.from_dict({"input_ids": [torch.randint(0, vocab, (k,), generator=g).int().tolist() for k in lens],
                       "loss_mask": [[1] * k for k in lens]}).save_to_disk(str(path))


def best_interleaved(fns: list, repeats: int) -> list[float]:
    """Best time of each function, run round-robin so load drift on a shared machine hits all alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [min(t) for t in times]


def baseline_bytes(target: FrozenTarget, ds, plan, out: Path) -> int:
    """One safetensors file per sample: 3 aux + final state bf16 + ids + mask (the public trainers' store)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for batch in plan:
        rows = ds.select(batch)
        for i, row, (aux, final, _) in zip(batch, rows, capture_rows(target, [r["input_ids"] for r in rows])):
            f = out / f"{i}.safetensors"
            save_file({"hidden_states": aux.to(torch.bfloat16).contiguous(),
                       "target": final.to(torch.bfloat16).contiguous(),
                       "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                       "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long)}, str(f))
            total += f.stat().st_size
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="local target directory (default: a random Llama)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="vllm: add the vLLM capture rows")
    ap.add_argument("--engine-python", default=None, help="vLLM's python (default .engine/venv/bin/python)")
    args = ap.parse_args()

    from datasets import load_from_disk
    from transformers import AutoConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_capture_"))
    path = args.target or build_target(args, tmp)
    hf = AutoConfig.from_pretrained(path)
    cfg = Config()
    cfg.recipe = "bench"
    t = cfg.target
    t.name_or_path, t.dtype = path, args.dtype
    t.num_hidden_layers, t.hidden_size, t.vocab_size = hf.num_hidden_layers, hf.hidden_size, hf.vocab_size
    cfg.capture.batch_tokens, cfg.capture.shard_size_mb = args.batch_tokens, 64
    cfg.drafter.draft_vocab_size = min(cfg.drafter.draft_vocab_size, hf.vocab_size)
    cfg.validate()
    device = torch.device(args.device)
    world = World(0, 1, 0, device)
    target = FrozenTarget.load(t, device, cfg.aux_layer_ids())
    build_data(tmp / "data", args.samples, hf.vocab_size, args.min_len, args.max_len)
    ds = load_from_disk(str(tmp / "data"))
    lengths = dataset_lengths(ds)
    tokens = sum(lengths)
    plan = plan_batches(list(range(len(lengths))), lengths, args.batch_tokens)
    batches = [pad_batch([ds[i]["input_ids"] for i in b], device) for b in plan]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def forward():
        for ids, mask in batches:
            target.model(input_ids=ids, attention_mask=mask, use_cache=False)
        sync()

    def capture(dtype: str):
        def run():
            cfg.capture.dtype = dtype
            store = tmp / f"store_{dtype}"
            import shutil
            shutil.rmtree(store, ignore_errors=True)
            capture_split(target, tmp / "data", store, cfg.capture, world, store_meta(cfg.target, dtype, target, None))
            sync()
        return run

    forward()  # warm-up (allocator, kernels)
    t_fwd, t_bf16, t_fp8 = best_interleaved([forward, capture("bf16"), capture("fp8")], args.repeats)
    size = {d: sum(p.stat().st_size for p in (tmp / f"store_{d}").rglob("*.safetensors")) for d in ("bf16", "fp8")}
    base = baseline_bytes(target, ds, plan, tmp / "baseline")
    H = hf.hidden_size

    print(f"\nTarget: {path if args.target else 'random Llama'} (L={hf.num_hidden_layers}, H={H}, V={hf.vocab_size}, "
          f"{args.dtype}) on {device}; {args.samples} samples, {tokens} tokens, batch_tokens={args.batch_tokens}, "
          f"aux ids {cfg.aux_layer_ids()}; best of {args.repeats}.\n")
    print("| path | tokens/s | vs plain forward | bytes/token | vs 8 x H baseline |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain forward (HF CausalLM, logits) | {tokens / t_fwd:,.0f} | 1.00 | - | - |")
    print(f"| baseline store (file per sample, bf16) | - | - | {base / tokens:,.0f} | {base / tokens / (8 * H):.2f} |")
    for d, tt in (("bf16", t_bf16), ("fp8", t_fp8)):
        print(f"| capture, {d} store | {tokens / tt:,.0f} | {t_fwd / tt:.2f} | {size[d] / tokens:,.0f} | "
              f"{size[d] / tokens / (8 * H):.2f} |")
    if args.engine == "vllm":
        bench_vllm(args, cfg, world, tmp, ds, plan, tokens, t_bf16, H, hf)


def bench_vllm(args, cfg, world, tmp: Path, ds, plan, tokens: int, t_hf: float, H: int, hf) -> None:
    """vLLM's prefill-only floor and the vLLM capture of the same samples (one engine start each)."""
    from fledge.data.capture.engine import EngineRun, build_request, capture_with_engine, engine_env, write_job
    from fledge.data.capture.offline import SplitCapture, describe_store
    from fledge.engine_process import engine_python
    from fledge.models.precision import compute_dtype

    python = engine_python(args.engine_python)
    if not python.exists():
        sys.exit(f"--engine vllm: no engine python at {python} (scripts/setup_engine.sh, or --engine-python)")
    device = world.device
    dtype = compute_dtype(getattr(torch, args.dtype), device, "--dtype")
    env = engine_env(device.type, 0, 0, 1, 1, 1, "127.0.0.1", 29500)
    aux = cfg.aux_layer_ids()
    longest = max(len(ds[i]["input_ids"]) for b in plan for i in b)
    floor_dir = tmp / "floor"
    job = write_job("bench", ds, plan, floor_dir)
    req = build_request(cfg.target.name_or_path, None, False, str(dtype).replace("torch.", ""), longest + 1,
                        [0, hf.num_hidden_layers], 1, False, 1, env, floor_dir, [job], floor=True)
    req["max_pending_batches"] = 0  # nobody consumes the floor's (empty) batches
    res = EngineRun(python, req, floor_dir, 3600).finish()
    t_floor, version = res["jobs"]["bench"]["wall_s"], res["vllm_version"]

    cfg.capture.engine, cfg.capture.dtype = "vllm", "bf16"
    meta = describe_store(cfg.target, "bf16", aux, hf.num_hidden_layers, H, hf.vocab_size, str(dtype), None)
    sc = SplitCapture(tmp / "data", tmp / "store_vllm", cfg.capture, world, meta)
    t0 = time.perf_counter()
    res = capture_with_engine({"bench": sc}, python, cfg.target.name_or_path, None, False, dtype, aux,
                              hf.num_hidden_layers, hf.rms_norm_eps,
                              {"tensor_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 1},
                              env, tmp / "engine", 3600, device)
    sc.finish()
    t_total = time.perf_counter() - t0 - res["load_s"]  # Fledge's whole capture, engine start-up excluded
    t_engine = res["jobs"]["bench"]["wall_s"]  # vLLM's generate calls with extraction, file moves included
    size = sum(p.stat().st_size for p in (tmp / "store_vllm").rglob("*.safetensors"))
    print(f"\nvLLM {version} ({dtype}, prefill only: one generated token per sample), one run each:\n")
    print("| path | tokens/s | vs vLLM prefill floor | vs HF capture (bf16) | bytes/token |")
    print("|---|---:|---:|---:|---:|")
    print(f"| vLLM prefill only (no extraction: the floor) | {tokens / t_floor:,.0f} | 1.00 | "
          f"{t_hf / t_floor:.2f} | - |")
    print(f"| vLLM generate with extract_hidden_states + connector | {tokens / t_engine:,.0f} | "
          f"{t_floor / t_engine:.2f} | {t_hf / t_engine:.2f} | - |")
    print(f"| capture.engine=vllm, whole capture (bf16 store) | {tokens / t_total:,.0f} | {t_floor / t_total:.2f} | "
          f"{t_hf / t_total:.2f} | {size / tokens:,.0f} |")


if __name__ == "__main__":
    main()
