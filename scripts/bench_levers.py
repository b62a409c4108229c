"""The sample-efficiency levers of the drafter recipe, measured on one captured store: every variant trains a drafter
from the same batches in one process, with Fledge's own model, loss and feature loader (train/ttt_model.py,
data/features/reader.py), the run's lr schedule (train/deepspeed_setup.py ``lr_lambda``) and the trainer's held-out
evaluation (train/held_out.py ``held_out_metrics``); only the optimizer, the lm_head, the clip, the schedule and the
architecture flags named in VARIANTS differ; the optimizer is the trainer's (train/optimizers.py, Muon with
``train.optim.name=muon``). A hand-written loop, not DeepSpeed: so a frozen head and the patched layers fit in.

    fledge run recipe=tiny run.stages=[prepare,capture]            # the store (any recipe; SmolLM2: recipe=smollm2)
    python scripts/bench_levers.py outputs/tiny --steps 400 --tokens 2048 --seeds 0 --device cpu \\
        --out outputs/levers_tiny --variants fledge frozen_head muon muon_frozen w1 clip1 linear_1pct norm_init \\
        nbr nbfc peer peer_arch

Writes ``<out>/levers.jsonl`` (one record per variant and seed; a re-run skips those already there) and
``<out>/levers.md``: held-out agreement per TTT step by Fledge's scorer (acc_k: given the steps before were right;
full_acc_k: every step up to k right, a target argmax outside the draft vocab a miss, as vLLM verifies) and, beside
it, speculators 0.9.0's full_acc_k computed on the same drafter ("peer-style": its step-k mask is the step's input
token's, and the teacher's argmax is taken over the draft vocab only, so out-of-vocab rows can be hits), the AL
estimate, seconds of training per variant, machine, date and the command.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import MethodType

import torch

# name: its differences from the run's recipe. cfg: config overrides (MUON: the trainer's Muon on the hidden matrices,
# AdamW on the rest, at speculators 0.9.0's momentum 0.95 and weight decay 0.1, the schema's defaults); head: frozen
# (lm_head kept at the target's rows); warmup_pct: warmup steps as a percentage of --steps; norm_init: the drafter's
# final norm from the target's; nbr: speculators' norm_before_residual (the first layer's residual is hidden_norm(g),
# not g). The peer's lr is the run's (speculators 0.9.0 defaults to 1e-3 for AdamW and Muon alike: its OptimizerArgs);
# peer_lr1e-4 is its recipe at 1e-4, the lr SpecForge publishes. vocab: the draft vocab's size as a multiple of
# the run's (at most the target's vocab; the top ids of the prepare stage's own counts, data/prepare/vocab.py);
# layer_init: the drafter's layer from the target's last decoder layer (its MLP, o_proj and norms as they are, the
# state half of q/k/v from the target's q/k/v, the embedding half left at its random init). The muon_* variants are
# the Muon recipe (recipe=smollm2's) with one lever changed; every variant is scored at the run's own K. bf16: what
# the trainer's deepspeed.bf16=true does (the module and its inputs in bf16, the optimizer stepping fp32 master weights
# copied back after each step), refused where the CPU has no native bf16 (models/precision.py: there it would run
# ~80x slower); scored in fp32 from the bf16 weights, as an export is served on CPU.
MUON = ["train.optim.name=muon"]
PEER_OPTIM = [*MUON, "drafter.step_weight=1.0", "train.optim.grad_clip=1.0", "train.optim.schedule=linear",
              "train.optim.betas=[0.9,0.999]", "train.optim.weight_decay=0.01"]
NBFC = ["drafter.fc_norm=false", "drafter.norm_before_fc=true"]
VARIANTS: dict[str, dict] = {
    "fledge": {},
    "frozen_head": {"head": "frozen"},
    "muon": {"cfg": MUON},
    "muon_frozen": {"cfg": MUON, "head": "frozen"},
    "w1": {"cfg": ["drafter.step_weight=1.0"]},
    "clip1": {"cfg": ["train.optim.grad_clip=1.0"]},
    "linear_1pct": {"cfg": ["train.optim.schedule=linear"], "warmup_pct": 1},
    "norm_init": {"norm_init": True},
    "nbr": {"nbr": True},
    "nbfc": {"cfg": NBFC},
    "peer": {"head": "frozen", "cfg": PEER_OPTIM, "warmup_pct": 1},
    "peer_lr1e-4": {"head": "frozen", "cfg": PEER_OPTIM + ["train.optim.lr=1e-4"], "warmup_pct": 1},
    "lr3e-4": {"cfg": ["train.optim.lr=3e-4"]},
    "lr3e-3": {"cfg": ["train.optim.lr=3e-3"]},
    "peer_arch": {"head": "frozen", "cfg": PEER_OPTIM + NBFC, "warmup_pct": 1, "nbr": True},
    "muon_w1": {"cfg": [*MUON, "drafter.step_weight=1.0"]},
    "muon_ttt5": {"cfg": [*MUON, "drafter.ttt_steps=5"]},
    "muon_norm_init": {"cfg": MUON, "norm_init": True},
    "muon_layer_init": {"cfg": MUON, "layer_init": True},
    "muon_lk": {"cfg": [*MUON, "drafter.loss=lk_lambda"]},
    "muon_tv": {"cfg": [*MUON, "drafter.loss=tv"]},
    "muon_vocab_x0.5": {"cfg": MUON, "vocab": 0.5},
    "muon_vocab_x2": {"cfg": MUON, "vocab": 2},
    "muon_bf16": {"cfg": MUON, "bf16": True},
}


class Refused(Exception):
    """Bad input: one line naming it and the fix."""


def load_config(run: Path, overrides: list[str]):
    """The run's own config (its config.yaml, as the run composed it) with ``overrides`` on top."""
    from omegaconf import OmegaConf

    from fledge.conf.compose import to_config
    from fledge.conf.schema import Config

    return to_config(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run / "config.yaml"),
                                     OmegaConf.from_dotlist(overrides)))


def check_run(run: Path) -> None:
    from fledge.atomic import read_json
    from fledge.run_layout import RunLayout

    for stage in ("prepare", "capture"):
        m = read_json(RunLayout(run).manifest(stage)) if (run / "config.yaml").is_file() else None
        if not (m or {}).get("complete"):
            raise Refused(f"{run}: no complete {stage} stage ({run}/{stage}/manifest.json); make one with "
                          f"`fledge run recipe=NAME run.output_root={run.parent} run.name={run.name} "
                          "'run.stages=[prepare,capture]'` first")


def _nbr_forward(self, emb, g, cos, sin, attend):
    """models/drafter.py _MidLayer.forward with speculators' norm_before_residual=True."""
    gn = self.hidden_norm(g)
    q, k, v = self.self_attn.project(torch.cat([self.input_layernorm(emb), gn], dim=-1), cos, sin)
    h1 = gn + self.self_attn.output(attend(q, k, v))
    return h1 + self.mlp(self.post_attention_layernorm(h1))


@torch.no_grad()
def peer_full_acc(model, batch, K: int) -> list[tuple[float, float]]:
    """speculators 0.9.0's full_acc_k (its eagle3 metrics module) on Fledge's batch, as (hits, rows) per step: row t
    at step k is scored against the teacher at t+1+k, its mask is loss_mask[t+1+k], and the teacher's argmax is
    over the draft vocab (renormalised)."""
    from fledge.models.alignment import shift, ttt_states

    d, ys = model.drafter, ttt_states(model.drafter, batch, K)
    t_arg = (batch.target_hidden.float() @ model.teacher_head.float().T).argmax(-1)
    prev, out = shift(batch.loss_mask, 1, False).clone(), []
    for k in range(K):
        same_doc = (batch.document_ids >= 0) & (shift(batch.document_ids, 1 + k, -2) == batch.document_ids)
        mask = shift(batch.loss_mask, 1 + k, False) & same_doc
        prev &= d.lm_head(ys[k]).argmax(-1) == shift(t_arg, 1 + k, -1)
        out.append((float((prev & mask).sum()), float(mask.sum())))
    return out


def init_from_last_layer(d, target: str, revision) -> None:
    """``layer_init``: the drafter's layer ``d.midlayer`` from the target's last decoder layer. The layer reads
    [embedding half, state half]; the target's layer reads one state, so its q/k/v go to the state half (and its
    input norm to ``hidden_norm``), the embedding half keeps its random init."""
    from fledge.models.weights import read_tensors, weight_map

    keys = sorted(weight_map(target, revision))
    last = max(int(k.split(".layers.")[1].split(".")[0]) for k in keys if ".layers." in k)
    prefix = next(k for k in keys if f".layers.{last}." in k).split(f".layers.{last}.")[0] + f".layers.{last}."
    w = {k[len(prefix):]: v.float() for k, v in read_tensors(target, [k for k in keys if k.startswith(prefix)],
                                                                revision).items()}
    m, H = d.midlayer, d.midlayer.hidden_norm.weight.shape[0]
    want = {n: p.shape for n, p in m.named_parameters()}
    want |= {f"self_attn.{n}.weight": want[f"self_attn.{n}.weight"][:1] + (H,) for n in ("q_proj", "k_proj", "v_proj")}
    want["input_layernorm.weight"] = want.pop("hidden_norm.weight")
    bad = sorted(k for k, shape in want.items() if tuple(w[k].shape) != tuple(shape)) if want.keys() <= w.keys() \
        else sorted(want.keys() - w.keys())
    if bad:
        raise Refused(f"--variants muon_layer_init: {target}'s layer {last} does not fit the drafter's layer "
                      f"({', '.join(bad)} missing or of another shape); it takes a Llama-like target whose hidden "
                      "size is the drafter's")
    with torch.no_grad():
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "post_attention_layernorm"):
            m.get_submodule(name).weight.copy_(w[f"{name}.weight"])
        m.hidden_norm.weight.copy_(w["input_layernorm.weight"])
        for name in ("q_proj", "k_proj", "v_proj"):
            m.self_attn.get_submodule(name).weight[:, H:].copy_(w[f"self_attn.{name}.weight"])


def train_variant(run: Path, name: str, seed: int, steps: int, tokens: int, device: torch.device) -> dict:
    from fledge.data.features.reader import FeatureLoader
    from fledge.data.prepare.vocab import DraftVocab
    from fledge.distributed import World
    from fledge.models.drafter import _MidLayer
    from fledge.models.weights import final_norm_name, read_tensors, weight_map
    from fledge.pipeline.stages import train_inputs
    from fledge.progress import LineProgress, is_terminal, progress
    from fledge.run_layout import RunLayout
    from fledge.train.deepspeed_setup import lr_lambda
    from fledge.train.held_out import held_out_metrics
    from fledge.train.optimizers import build_optimizer
    from fledge.train.ttt_model import build_ttt_model

    lever, layout = VARIANTS[name], RunLayout(run)
    if lever.get("bf16"):
        require_native_bf16(name, device)
    ov = [*lever.get("cfg", []), f"run.seed={seed}"]
    if "warmup_pct" in lever:
        ov.append(f"train.optim.warmup_steps={steps * lever['warmup_pct'] // 100}")
    base, counts = load_config(run, []), DraftVocab.load(layout.prepare.vocab).counts
    size = min(len(counts), round(base.drafter.draft_vocab_size * lever.get("vocab", 1)))
    cfg = load_config(run, [*ov, f"drafter.draft_vocab_size={size}"])
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = layout.prepare.vocab
        if "vocab" in lever:  # the prepare stage's counts, another size
            vocab = Path(tmp) / "vocab.safetensors"
            DraftVocab.build(counts, size).save(vocab)
        model = build_ttt_model(train_inputs(cfg), vocab, device)
    d = model.drafter
    if lever.get("layer_init"):
        init_from_last_layer(d, cfg.target.name_or_path, cfg.target.revision)
    if lever.get("nbr"):
        for m in d.modules():
            if isinstance(m, _MidLayer):
                m.forward = MethodType(_nbr_forward, m)
    if lever.get("norm_init"):
        src, rev = cfg.target.name_or_path, cfg.target.revision
        key = final_norm_name(weight_map(src, rev))
        with torch.no_grad():
            d.norm.weight.copy_(read_tensors(src, [key], rev)[key].float())
    if lever.get("head") == "frozen":
        d.lm_head.weight.requires_grad_(False)
    master = model  # the weights the optimizer steps: an fp32 copy when the module computes in bf16
    if lever.get("bf16"):
        master = copy.deepcopy(model)
        model.to(torch.bfloat16)
    params = [p for p in master.parameters() if p.requires_grad]
    optimizer = build_optimizer(master, cfg.train.optim)  # after the head is frozen: a frozen head has no optimizer
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train.optim, steps))
    clip = cfg.train.optim.grad_clip or math.inf
    compute = torch.bfloat16 if lever.get("bf16") else torch.float32
    train = FeatureLoader(layout.capture.store("train"), 0, 1, tokens, 1, seed, dtype=compute)
    bar = progress(total=steps, desc=f"{name} seed {seed}", unit="step") if is_terminal() else \
        LineProgress(total=steps, desc=f"{name} seed {seed}", unit="step", every_s=5, file=sys.stdout)
    t0, norms = time.perf_counter(), []
    for _ in range(steps):
        _, batch = train.next_batch()
        loss = model(batch.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if master is not model:  # bf16 gradients to the fp32 master weights
            for pm, pb in zip(master.parameters(), model.parameters(), strict=True):
                pm.grad, pb.grad = (None if pb.grad is None else pb.grad.float()), None
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        optimizer.step()
        if master is not model:
            with torch.no_grad():
                for pm, pb in zip(master.parameters(), model.parameters(), strict=True):
                    pb.copy_(pm)
        schedule.step()
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    model.float()  # scored in fp32 (from the bf16 weights after a bf16 run), as served on CPU
    heldout = FeatureLoader(layout.capture.store("eval"), 0, 1, tokens, 1, seed, dtype=torch.float32)
    K = base.drafter.draft_steps()  # the run's K for every variant, so their columns compare
    ev = held_out_metrics(model, heldout, cfg.train.eval_batches, K, World(0, 1, 0, device), torch.float32)
    peer = [[0.0, 0.0] for _ in range(K)]
    for batch, counts in heldout.eval_batches(cfg.train.eval_batches):
        for k, (hits, rows) in enumerate(peer_full_acc(model, batch.to(device), K) if counts else []):
            peer[k][0] += hits
            peer[k][1] += rows
    with torch.no_grad():
        drift = float((d.lm_head.weight - model.teacher_head).norm() / model.teacher_head.norm())
    r4 = lambda xs: [round(float(x), 4) for x in xs]  # noqa: E731
    return {"variant": name, "seed": seed, "steps": steps, "tokens_per_step": tokens, "train_s": round(train_s, 1),
            "draft_vocab_size": size,
            "heldout_acc": r4(ev[f"eval/acc_{k}"] for k in range(K)),
            "heldout_full_acc": r4(ev[f"eval/full_acc_{k}"] for k in range(K)),
            "heldout_al_estimate": round(float(ev["eval/al_estimate"]), 4),
            "heldout_peer_style_full_acc": r4(h / max(n, 1) for h, n in peer),
            "first_grad_norms": r4(norms[:3]),
            "head_drift": round(drift, 4)}


def require_native_bf16(name: str, device: torch.device) -> None:
    """Refused where the CPU would emulate bf16: the lever is native bf16's."""
    from fledge.models.precision import cpu_bf16_native

    if device.type == "cpu":
        native, why = cpu_bf16_native()
        if not native:
            raise Refused(f"--variants {name}: {why}; bf16 compute is measured only where it is native "
                          f"(FLEDGE_CPU_BF16=1 forces it)")


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch thread(s)"


def table(records: list[dict]) -> str:
    f = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["| variant | seed | steps x tokens | train s | held-out acc_k | held-out full_acc_k | AL estimate | "
             "peer-style full_acc_k | first grad norms | head drift |", "|---" * 10 + "|"]
    lines += [f"| {r['variant']} | {r['seed']} | {r['steps']} x {r['tokens_per_step']} | {r['train_s']} | "
              f"{f(r['heldout_acc'])} | {f(r['heldout_full_acc'])} | {r['heldout_al_estimate']:.3f} | "
              f"{f(r['heldout_peer_style_full_acc'])} | {r['first_grad_norms']} | {r['head_drift']:.3f} |"
              for r in records]
    machines, dates = sorted({r["machine"] for r in records}), sorted({r["date"][:10] for r in records})
    return "\n".join([*lines, "", f"Machine: {'; '.join(machines)}. Date: {', '.join(dates)}.",
                      "Command: `" + "`; `".join(sorted({r["command"] for r in records})) + "`", ""])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path, help="a run directory whose prepare and capture stages are complete")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per variant")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per optimizer step (one packed row)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=None, help="where levers.jsonl and levers.md go (default: RUN/levers)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="of: " + " ".join(VARIANTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from fledge.atomic import read_jsonl, write_bytes_atomic

    args = parse(argv)
    try:
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            raise Refused(f"--variants {' '.join(unknown)}: no such variant; pick from {' '.join(VARIANTS)}")
        if args.steps < 1 or args.tokens < 1:
            raise Refused(f"--steps {args.steps} --tokens {args.tokens}: both must be >= 1")
        check_run(args.run)
        for name in args.variants:  # before any variant trains, not after the ones listed first
            if VARIANTS[name].get("bf16"):
                require_native_bf16(name, torch.device(args.device))
    except Refused as e:
        print(f"bench_levers: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or args.run / "levers"
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "levers.jsonl"
    records = read_jsonl(jsonl, "delete that line to measure its variant again") if jsonl.exists() else []
    device = torch.device(args.device)
    command = " ".join(["python", "scripts/bench_levers.py", *(sys.argv[1:] if argv is None else argv)])
    for seed in args.seeds:
        for name in args.variants:
            if any((r["variant"], r["seed"], r["steps"], r["tokens_per_step"]) == (name, seed, args.steps, args.tokens)
                   for r in records):
                print(f"{name} seed {seed}: already in {jsonl}, skipped", flush=True)
                continue
            try:
                rec = train_variant(args.run, name, seed, args.steps, args.tokens, device)
            except Refused as e:
                print(f"bench_levers: {e}", file=sys.stderr)
                return 2
            rec.update(device=str(device), machine=machine(device), command=command,
                       date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
            records.append(rec)
            write_bytes_atomic(jsonl, "".join(json.dumps(r) + "\n" for r in records).encode())
            write_bytes_atomic(out / "levers.md", table(records).encode())
            print(json.dumps(rec), flush=True)
    write_bytes_atomic(out / "levers.md", table(records).encode())  # also when every variant was there already
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
