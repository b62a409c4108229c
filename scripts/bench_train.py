"""Benchmark the training step: tokens/s, peak memory and (on GPU) MFU of the real TTT step under DeepSpeed.

One step = forward + backward + optimizer step of ``train.ttt_model.TTTModel`` wrapped by
``train.engine.build_engine`` (config composed from conf/ like ``train/main.py``, a world of one), on
synthetic ``FeatureBatch`` rows: one packed row of T tokens per step holding three documents (50/30/15 %
of T) and 5 % padding, every token loss-masked and every teacher argmax inside the draft vocab, so all
rows the loss can count are counted. Tokens/s counts real (non-padding) tokens per optimizer step over
the median step time, warmup steps excluded.

Configurations: ``tiny`` (the tiny recipe: H 256, heads 4/2, I 512, Vd 2048, K 3, T 1024), ``mid``
(H 1024, heads 8/2, I 3584, Vd 8000, K 7, T 2048) and ``llama8b`` (Llama-3-8B-shaped: H 4096, heads 32/8,
head_dim 128, I 14336, Vd 32000, V 128256, K 7, T 4096). fp32 on CPU, bf16 on CUDA (the engine's rule).
Each config runs four variants, every one in a fresh subprocess: ``ttt`` (K steps, ZeRO-2 as the
recipes), ``k1`` (one step: the ratio is the cost of training-time test), ``zero0`` (K steps without
ZeRO) and ``perstep`` (K steps with the earlier loss that recomputes the teacher in every step, which
ZeRO-3 still uses; train/losses). Ratios are against ``ttt`` measured in the same run, so the shared machine's
noise cancels. ``--losses tv rkl ...`` adds the ``ttt`` variant with each of those losses (``drafter.loss``;
``mix`` is ttt_ce 0.5 + tv 0.5): the training cost per step of each against the default ``ttt_ce``.
``step CPU-s`` (the process's CPU time per step, median) is the figure to compare on shared cores, where wall
time follows the other jobs' load.

Memory: on CPU the peak RSS of the subprocess, and ``train MiB`` = that minus the peak of a subprocess
that only imports the same modules and builds the model and batch (so: gradients, optimizer state,
DeepSpeed buffers, activations). On CUDA ``torch.cuda.max_memory_allocated`` over the timed steps (the
whole peak: weights, optimizer state and activations), and ``train MiB`` = that minus what was allocated
right after the engine was built.

MFU = model FLOPs per step / median step time / ``--peak-flops`` (default 989e12: H100/H200 bf16 dense).
Model FLOPs are counted analytically (no recomputation, elementwise ops ignored), PaLM-style:
  - every trainable matmul costs 6 FLOPs per weight per row it processes (2 forward, 4 backward):
    ``fc`` once per real token; the mid-layer (q/k/v/o, gate/up/down) once per real token per TTT step;
    the drafter ``lm_head`` once per *counted* row per step (the loss only computes counted rows:
    sum over documents of max(0, L - 2 - k) at step k);
  - the teacher, once per teacher row any step reads (the K steps share it; train/losses): its logits
    (target_hidden @ teacher_head^T, frozen) 2 * Ht * Vd, and q = softmax(.) @ lm_head 4 * Vd * H (forward,
    and the backward to lm_head only);
  - attention at step k: each query head scores (t + 1) causal step-0 keys of its document plus k
    diagonal keys; QK^T and PV cost 4 * head_dim FLOPs per (query head, key) forward, x3 with backward;
  - the frozen embedding lookup, norms, RoPE and softmaxes: 0. Padding rows (computed, useless): 0.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_train.py                  # tiny + mid on CPU
    .venv/bin/python scripts/bench_train.py --device cuda                      # llama8b on a GPU
    .venv/bin/python scripts/bench_train.py --configs tiny --variants ttt k1 --steps 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "BENCH_TRAIN_RESULT "
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# shape: a transformers LlamaConfig-shaped dict of the target; recipe: the conf/recipe the config composes from.
CONFIGS = {
    "tiny": dict(recipe="tiny", vd=2048, K=3, T=1024, chunk=512, shape=dict(model_type="llama",
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mid": dict(recipe="llama3", vd=8000, K=7, T=2048, chunk=1024, shape=dict(model_type="llama",
        vocab_size=16000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=32, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE)),
    "llama8b": dict(recipe="llama3", vd=32000, K=7, T=4096, chunk=1024, shape=dict(model_type="llama",
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=LLAMA3_ROPE)),
}
VARIANTS = {"ttt": dict(k1=False, zero=2), "k1": dict(k1=True, zero=2), "zero0": dict(k1=False, zero=0),
            "perstep": dict(k1=False, zero=2, per_step_teacher=True)}
DOC_FRACTIONS = (0.50, 0.30, 0.15)  # of T; the remaining 5 % is padding


def doc_lengths(T: int) -> list[int]:
    return [int(T * f) for f in DOC_FRACTIONS]


def train_flops(spec, steps: int, docs: list[int]) -> float:
    """Model FLOPs of one optimizer step on one packed row (see the module docstring for the rules)."""
    H, I, D = spec.hidden_size, spec.intermediate_size, spec.head_dim
    Hq, Hkv, Vd, Ht = spec.num_attention_heads, spec.num_key_value_heads, spec.draft_vocab_size, spec.target_hidden_size
    tokens = sum(docs)
    layer_weights = 2 * H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * I  # q/k/v over [emb, g], o, MLP
    flops = 6 * spec.fc_in_features * H * tokens
    teacher_rows = sum(max(0, L - 2) for L in docs)  # rows 1..L-2 of each document: the union over steps
    flops += (2 * Ht * Vd + 4 * Vd * H) * teacher_rows
    for k in range(steps):
        counted = sum(max(0, L - 2 - k) for L in docs)
        keys = sum(L * (L + 1) // 2 + k * L for L in docs)
        flops += 6 * layer_weights * tokens + 6 * H * Vd * counted + 12 * D * Hq * keys
    return float(flops)


# --losses: the mix's parts (one mix; compare_losses.py sweeps others)
MIX = "+drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}"


def _compose(name: str, k1: bool, zero: int, loss: str = "ttt_ce"):
    from fledge.conf import compose

    c = CONFIGS[name]
    overrides = [f"recipe={c['recipe']}", f"drafter.draft_vocab_size={c['vd']}",
                 f"drafter.ttt_steps={1 if k1 else c['K']}", f"drafter.loss_chunk_size={c['chunk']}",
                 f"train.micro_batch_tokens={c['T']}", "train.micro_batch_size=1", "train.grad_accum=1",
                 f"deepspeed.zero_stage={zero}", "deepspeed.offload_optimizer=false",
                 f"target.num_hidden_layers={c['shape']['num_hidden_layers']}",
                 f"target.hidden_size={c['shape']['hidden_size']}", f"target.vocab_size={c['shape']['vocab_size']}",
                 f"drafter.loss={loss}", *([MIX] if loss == "mix" else [])]
    return compose(overrides)


def _build(name: str, cfg, device):
    """TTTModel (random weights, random vocab map) and one synthetic batch on ``device``."""
    import torch

    from fledge.data.features.batch import FeatureBatch
    from fledge.models.algorithms import DrafterSpec
    from fledge.models.drafter import Eagle3Drafter
    from fledge.train.losses import build_loss
    from fledge.train.ttt_model import TTTModel

    c = CONFIGS[name]
    V, Vd, T = c["shape"]["vocab_size"], c["vd"], c["T"]
    spec = DrafterSpec.from_target_config(copy.deepcopy(c["shape"]), cfg.drafter, cfg.aux_layer_ids())
    torch.manual_seed(cfg.run.seed)
    with device:  # initialise in place: the 8B-shaped embedding alone is 2 GiB of fp32
        drafter = Eagle3Drafter(spec, attention=cfg.drafter.attention, norm_impl=cfg.drafter.norm_impl)
    selected = torch.randperm(V)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    drafter.set_vocab((selected - torch.arange(Vd)).to(device), t2d.to(device))
    teacher_head = torch.randn(Vd, spec.target_hidden_size, device=device) * spec.target_hidden_size**-0.5
    model = TTTModel(drafter, teacher_head, build_loss(cfg.drafter)).to(device)

    docs = doc_lengths(T)
    doc_ids = torch.full((1, T), -1, dtype=torch.int32)
    pos = torch.zeros(1, T, dtype=torch.int64)
    a = 0
    for i, L in enumerate(docs):
        doc_ids[0, a : a + L], pos[0, a : a + L] = i, torch.arange(L)
        a += L
    Ht, n_aux = spec.target_hidden_size, len(spec.aux_layer_ids)
    batch = FeatureBatch(
        input_ids=torch.randint(0, V, (1, T)), loss_mask=doc_ids >= 0,
        aux_hidden=torch.randn(1, T, n_aux * Ht), target_hidden=torch.randn(1, T, Ht),
        target_argmax=selected[torch.randint(0, Vd, (1, T))], position_ids=pos, document_ids=doc_ids)
    return model, batch, spec


def _one(job: dict) -> dict:
    """One measurement in this (fresh) process; ``job['mode']`` is ``train`` or ``build`` (memory baseline)."""
    import deepspeed  # noqa: F401  (imported by the baseline too, so its RSS cancels)
    import torch

    from fledge.distributed import destroy_world, init_world
    from fledge.pipeline.stages import train_inputs
    from fledge.train.deepspeed_setup import build_engine, use_bf16

    world = init_world()
    name, var = job["config"], VARIANTS[job["variant"]]
    if var.get("per_step_teacher"):  # the earlier loss: the teacher recomputed in every step (ZeRO-3's path)
        import fledge.train.losses.paths

        fledge.train.losses.paths.partitioned = lambda lm_head: True
    loss = job.get("loss", "ttt_ce")
    cfg = _compose(name, var["k1"], var["zero"], loss)
    cuda = world.device.type == "cuda"
    model, batch, spec = _build(name, cfg, world.device)
    variant = job["variant"] + (f" {loss}" if loss != "ttt_ce" else "")
    out = {"config": name, "variant": variant, "K": cfg.drafter.ttt_steps, "zero": var["zero"],
           "T": CONFIGS[name]["T"], "tokens": batch.num_tokens,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if job["mode"] == "build":
        out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        destroy_world()
        return out

    bf16 = use_bf16(cfg.deepspeed, world)
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine, _, _ = build_engine(model, train_inputs(cfg), world, total_steps=job["warmup"] + job["steps"])
    model.cast_teacher(dtype)  # as the trainer does: DeepSpeed's bf16 casts parameters, not buffers
    batch = batch.to(world.device, dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        static = torch.cuda.memory_allocated()
    times, cpu_times, losses = [], [], []
    for i in range(job["warmup"] + job["steps"]):
        if cuda and i == job["warmup"]:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(batch).loss
        engine.backward(loss)
        engine.step()
        sync()
        if i >= job["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        losses.append(loss.item())
    if cuda:
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["train_mib"] = (torch.cuda.max_memory_allocated() - static) / 2**20
    else:
        out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.update(step_s=statistics.median(times), times=times, step_cpu_s=statistics.median(cpu_times),
               losses=losses, dtype=str(dtype).split(".")[-1],
               flops=train_flops(spec, cfg.drafter.ttt_steps, doc_lengths(CONFIGS[name]["T"])))
    destroy_world()
    return out


def _run(job: dict, device: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "DS_ACCELERATOR": device, "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a world of one, whatever launched us
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # init_world takes CUDA whenever it sees it
    res = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    lines = [x for x in res.stdout.splitlines() if x.startswith(MARK)]
    if res.returncode != 0 or not lines:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1][:120]
        return {**job, "error": f"exit {res.returncode}: {tail}"}
    return json.loads(lines[-1][len(MARK):])


def _table(rows: list[dict], device: str, peak: float | None) -> str:
    head = ("| config | variant | K | ZeRO | dtype | tokens/step | step s | step CPU-s | CPU-s vs ttt | tokens/s "
            "| tok/s vs ttt | peak MiB "
            "| train MiB | train MiB vs ttt | TFLOP/s | MFU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ref = {r["config"]: r for r in rows if r.get("variant") == "ttt" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['variant']} | | | | | | | | | | | | | | {r['error']} |")
            continue
        tps, base = r["tokens"] / r["step_s"], ref.get(r["config"])
        vs = f"{tps / (base['tokens'] / base['step_s']):.2f}x" if base else "-"
        cpu_vs = f"{r['step_cpu_s'] / base['step_cpu_s']:.2f}x" if base else "-"
        mem_vs = f"{r['train_mib'] / base['train_mib']:.2f}x" if base and base.get("train_mib", 0) > 0 else "-"
        tflops = r["flops"] / r["step_s"] / 1e12
        mfu = f"{100 * tflops * 1e12 / peak:.1f} %" if peak else "-"
        train_mib = f"{r['train_mib']:.0f}" if "train_mib" in r else "-"
        lines.append(f"| {r['config']} | {r['variant']} | {r['K']} | {r['zero']} | {r['dtype']} | {r['tokens']} | "
                     f"{r['step_s']:.3f} | {r['step_cpu_s']:.3f} | {cpu_vs} | {tps:.0f} | {vs} | {r['peak_mib']:.0f} | "
                     f"{train_mib} | {mem_vs} | "
                     f"{tflops:.3g} | {mfu} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="default: tiny mid (cpu), llama8b (cuda)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--losses", nargs="+", default=[], help="also the ttt variant with each of these registered "
                    "losses (drafter.loss; mix = ttt_ce 0.5 + tv 0.5): the training cost of each against ttt_ce")
    ap.add_argument("--steps", type=int, help="timed steps, median reported (default 3 cpu, 10 cuda)")
    ap.add_argument("--warmup", type=int, help="untimed first steps (default 1 cpu, 3 cuda: flex compiles)")
    ap.add_argument("--peak-flops", type=float, help="for MFU; default 989e12 on cuda (H100/H200 bf16 dense), "
                    "none on cpu (TFLOP/s is still reported)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(MARK + json.dumps(_one(json.loads(args.one))), flush=True)
        return
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda="
                 f"{torch.version.cuda}); run on a GPU machine, or use --device cpu")
    configs = args.configs or (["llama8b"] if cuda else ["tiny", "mid"])
    steps, warmup = args.steps or (10 if cuda else 3), args.warmup if args.warmup is not None else (3 if cuda else 1)
    if steps < 1 or warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    peak = args.peak_flops or (989e12 if cuda else None)
    variants = ["ttt"] + [v for v in args.variants if v != "ttt"]  # the ratios' baseline always runs
    rows = []
    for name in configs:
        base = None if cuda else _run({"config": name, "variant": "ttt", "mode": "build"}, args.device)
        for v in variants:
            r = _run({"config": name, "variant": v, "mode": "train", "steps": steps, "warmup": warmup}, args.device)
            if base and "error" not in r:
                r["train_mib"] = r["peak_mib"] - base.get("rss_mib", r["peak_mib"])
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "times"}), file=sys.stderr, flush=True)
        for loss in args.losses:
            r = _run({"config": name, "variant": "ttt", "loss": loss, "mode": "train", "steps": steps,
                      "warmup": warmup}, args.device)
            if base and "error" not in r:
                r["train_mib"] = r["peak_mib"] - base.get("rss_mib", r["peak_mib"])
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "times"}), file=sys.stderr, flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"\n{args.device}, OMP_NUM_THREADS={threads}, 1 packed row of T tokens per step (3 documents + 5 % "
          f"padding), median of {steps} steps after {warmup} warmup; ratios vs the ttt row of the same config\n")
    print(_table(rows, args.device, peak))


if __name__ == "__main__":
    main()
