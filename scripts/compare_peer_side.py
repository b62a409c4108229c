"""The peer's side of scripts/compare_peer.py: vLLM's speculators 0.9.0 trains an EAGLE-3 drafter on a Fledge capture
converted by scripts/peer_store.py, and one scorer measures any speculators-format drafter on the held-out rows. Runs
in the peer's process (.venv's python, .oracle/site first on PYTHONPATH, a dotenv stand-in after it); imports
nothing from Fledge.

    python scripts/compare_peer_side.py train PLAN.json
    python scripts/compare_peer_side.py heldout DATA_DIR OUT.json STEPS NAME=DIR ...

``train`` runs the peer's own trainer (``speculators.train.cli.main``) with its defaults except what the plan fixes
(the data, draft vocabulary, aux layer ids, TTT steps, batch tokens, held-out split, and for ``optim`` Fledge's
optimizer settings). Its step count is computed here from the budget of tokens with its own packer and seed
(``MultipackDistributedBatchSamplerV2``), and its epoch count set so the run stops there: past ``--max-steps``
mid-epoch, 0.9.0 goes on to the next epoch and trains one step in each. Patched at run time, in this process only:

- the trainer's device: ``get_local_rank`` -> "cpu" (it moves the model and batches to device index 0, a GPU);
- ``torch.accelerator.synchronize`` -> no-op (its step timer calls it on every logged step; no accelerator here);
- with Fledge's optimizer only (AdamW, or Muon when the run trained with it): ``clip_grad_norm_``'s max norm
  (hard-coded 1.0 in its trainer) and AdamW's betas (torch's defaults there) set to Fledge's;
- its console logging (rich, a line per step) goes to ``train.log``; a metrics handler writes ``metrics.jsonl`` and
  prints a progress line every few seconds.

Held-out agreement: each row unrolled ``STEPS`` TTT steps by the peer's own forward (teacher-forced on the data
tokens, as both trainers train); full_acc_k is the share of positions where the drafts of steps 1..k all equal the
target's full-vocab argmax (a draft id mapped through d2t; an argmax outside the draft vocab is a miss, as vLLM
verifies), counted where the token step k predicts is an assistant token: Fledge's scorer's convention. The AL
estimate is 1 + their sum.
"""

import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import torch

PROGRESS_S = 5.0


def plan_steps(lengths: list[int], total_seq_len: int, seed: int, budget: int) -> tuple[int, int, int]:
    """(steps, epochs, tokens): the peer's batches, in its order, until their tokens reach ``budget``."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(total_seq_len, lengths, num_replicas=1, rank=0, seed=seed)
    clipped = [min(n, total_seq_len) for n in lengths]
    steps = tokens = epoch = 0
    while tokens < budget:
        for batch in sampler._generate_batches(epoch):  # noqa: SLF001 (the order its trainer iterates)
            steps, tokens = steps + 1, tokens + sum(clipped[i] for i in batch)
            if tokens >= budget:
                break
        epoch += 1
    return steps, epoch, tokens


def train_argv(plan: dict, data: dict, steps: int, epochs: int, seed: int) -> list[str]:
    """The peer's command line: its defaults, except what the comparison fixes."""
    out = Path(plan["out"])
    argv = ["--verifier-name-or-path", plan["verifier"], "--data-path", data["rows"],
            "--hidden-states-path", data["hidden_states"], "--d2t-path", data["d2t"], "--t2d-path", data["t2d"],
            "--draft-vocab-size", str(data["draft_vocab_size"]),
            "--target-layer-ids", *map(str, data["target_layer_ids"]), "--ttt-steps", str(plan["ttt_steps"]),
            "--total-seq-len", str(plan["total_seq_len"]), "--train-data-ratio", repr(data["train_data_ratio"]),
            "--epochs", str(epochs), "--max-steps", str(steps), "--save-path", str(out / "checkpoints"),
            "--log-dir", str(out / "logs"), "--on-missing", "raise", "--no-resume-from-checkpoint",
            # CPU: no flex attention backward, no fused loss kernels, fp32 states, no worker processes
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
            "--num-workers", "0", "--seed", str(seed)]
    o = plan["optim"]
    if o:
        # HF's schedules, as the peer has them: warmup from lr 0 (Fledge's from lr/warmup), decay to 0; its "none"
        # for Fledge's constant has no warmup at all
        schedule = {"cosine": "cosine", "linear": "linear", "constant": "none"}[o["schedule"]]
        argv += ["--optimizer", o.get("name", "adamw"), "--lr", repr(o["lr"]),
                 "--weight-decay", repr(o["weight_decay"]), "--scheduler-type", schedule,
                 "--scheduler-warmup-steps", str(o["warmup_steps"])]
        if o.get("name") == "muon":  # the peer's own Muon (its split of the matrices) at Fledge's settings
            argv += ["--muon-lr", repr(o["muon_lr"]), "--muon-momentum", repr(o["muon_momentum"]),
                     "--muon-weight-decay", repr(o["muon_weight_decay"])]
    return argv


class Progress(logging.Handler):
    """On the peer's metrics logger: each record to metrics.jsonl, a progress line every PROGRESS_S seconds."""

    def __init__(self, name: str, steps: int, path: Path):
        super().__init__()
        self.name_, self.steps, self.file = name, steps, open(path, "w")  # noqa: SIM115 (closed at exit)
        self.t0 = self.shown = time.time()

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict) or "hparams" in record.__dict__:
            return
        self.file.write(json.dumps(msg, default=float) + "\n")
        self.file.flush()
        now = time.time()
        if "train" in msg and now - self.shown >= PROGRESS_S:
            self.shown, step = now, msg["global_step"] + 1
            left = (now - self.t0) / step * (self.steps - step)
            print(f"[peer] {self.name_}: step {step}/{self.steps}, loss {msg['train'].get('loss', math.nan):.3f}, "
                  f"{now - self.t0:.0f} s, ~{left:.0f} s left", flush=True)
        elif "val" in msg:
            print(f"[peer] {self.name_}: validation after epoch {msg['epoch']}: loss "
                  f"{msg['val'].get('loss_epoch', math.nan):.3f}", flush=True)


def patch(plan: dict, progress: Progress, log_path: Path) -> list[str]:
    """The run-time patches (module docstring); returns what was patched, for done.json."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
    done = ["trainer device -> cpu", "torch.accelerator.synchronize -> no-op", "console log -> train.log"]

    def root_logger(level="INFO"):
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s", force=True,
                            handlers=[logging.FileHandler(log_path, mode="w")])

    def metric_logger(*args, **kwargs):
        original_metric_logger(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(progress)

    original_metric_logger = cli.setup_metric_logger
    cli.setup_root_logger, cli.setup_metric_logger = root_logger, metric_logger
    o = plan["optim"]
    if o:
        clip, build = torch.nn.utils.clip_grad_norm_, trainer.build_optimizers

        def clip_at_fledges(params, max_norm, *args, **kwargs):
            return clip(params, o["grad_clip"], *args, **kwargs)

        def with_fledges_betas(model, config):
            optimizers = build(model, config)
            for group in (g for opt in optimizers for g in opt.param_groups if "betas" in g):  # AdamW's groups
                group["betas"] = tuple(o["betas"])
            return optimizers

        torch.nn.utils.clip_grad_norm_, trainer.build_optimizers = clip_at_fledges, with_fledges_betas
        done += [f"grad clip 1.0 -> {o['grad_clip']}", f"AdamW betas -> {tuple(o['betas'])}"]
    return done


def train(plan_path: str) -> None:
    """Train one peer run (its plan from compare_peer.py) and write done.json beside its checkpoints."""
    import speculators.train.cli as cli
    from datasets import load_from_disk
    from speculators.train.config import TrainConfig

    plan = json.loads(Path(plan_path).read_text())
    data, out = plan["data"], Path(plan["out"])
    if plan["optim"] and plan["optim"]["min_lr_ratio"]:
        print(f"[peer] {plan['name']}: Fledge's min_lr_ratio {plan['optim']['min_lr_ratio']} has no peer setting; "
              "its schedule decays to 0", flush=True)
    lengths = list(load_from_disk(data["rows"]).with_format(None)["seq_len"])[:data["train_rows"]]
    # its default seed for a Fledge run of run.seed 0, one more for each seed above: seed s pairs the two trainers
    seed = TrainConfig().seed + plan.get("run_seed", 0)
    steps, epochs, tokens = plan_steps(lengths, plan["total_seq_len"], seed, plan["budget_tokens"])
    print(f"[peer] {plan['name']}: {steps} steps over {epochs} epochs = {tokens:,} tokens "
          f"(Fledge's budget {plan['budget_tokens']:,})", flush=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a run cut short starts over
    argv = train_argv(plan, data, steps, epochs, seed)
    progress = Progress(plan["name"], steps, out / "metrics.jsonl")
    patched = patch(plan, progress, out / "train.log")
    t0 = time.time()
    cli.main(TrainConfig.resolve(argv))
    seconds = time.time() - t0
    last = max((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    done = {"checkpoint": str(last), "steps": steps, "epochs": epochs, "tokens": tokens, "seconds": seconds,
            "total_seq_len": plan["total_seq_len"], "seed": seed, "finished": time.time(), "plan": plan,
            "argv": argv, "patched": patched}
    (out / "done.json").write_text(json.dumps(done, indent=1))
    print(f"[peer] {plan['name']}: done in {seconds:.0f} s -> {last}", flush=True)


def load_drafter(path: str):
    """A speculators-format drafter, loaded as the peer loads one (sdpa attention: flex has no CPU kernels)."""
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32)
    files = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            files.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    # The target's embedding for the input tokens (the checkpoint's other tensors stay). 0.9.0 loads it only where
    # from_pretrained left NaN, and transformers 5 leaves a tensor missing from the files uninitialised (zeros,
    # leftover values or NaN, whatever the memory held): a checkpoint without embed_tokens.weight (Fledge's
    # exports, vLLM's layout) would be scored with no input embeddings.
    model._load_verifier_weights(overwrite_embed_tokens="embed_tokens.weight" not in files)  # noqa: SLF001
    if not model.embed_tokens.weight.any():
        raise SystemExit(f"{path}: the drafter's input embedding is all zeros after loading the target's "
                         f"({config.speculators_config.verifier.name_or_path})")
    # its from_pretrained forgives missing tensors: every one the drafter owns must come from the files, as shaped
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    verifier = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    wrong = sorted((set(params) - set(files) - verifier) | (set(files) - set(params))
                   | {k for k in set(files) & set(params) if files[k] != params[k]})
    if wrong:
        raise SystemExit(f"{path}: tensors missing, unexpected or of another shape for speculators' Eagle3DraftModel: "
                         f"{wrong}")
    return model.eval()


@torch.no_grad()
def row_hits(model, hs: dict, mask: torch.Tensor, argmax: torch.Tensor, steps: int) -> tuple[list[int], list[int]]:
    """One held-out row: per step k, (positions whose steps 1..k all hit, positions scored at step k)."""
    T = hs["token_ids"].numel()
    aux = hs["hidden_states"][:, :-1].flatten(1).float()
    # the peer's alignment (speculators/models/eagle3/data.py shift_batch): position t reads state t and token t+1
    drafts = model(hidden_states=aux[:-1].unsqueeze(0), input_ids=hs["token_ids"][1:].unsqueeze(0),
                   document_ids=torch.zeros(1, T - 1, dtype=torch.long),
                   position_ids=torch.arange(1, T).unsqueeze(0), ttt_steps=steps)
    alive = torch.ones(T - 1, dtype=torch.bool)
    hits, scored = [], []
    for k, d in enumerate(drafts):  # step k at t drafts token t+2+k; the target's choice there is argmax[t+1+k]
        n = T - 2 - k  # positions with a target token to compare
        if n <= 0:
            hits.append(0), scored.append(0)
            continue
        ids = d[0, :n] + model.d2t[d[0, :n]]
        alive = alive[:n] & (ids == argmax[1 + k:1 + k + n])
        counted = mask[2 + k:2 + k + n].bool()
        hits.append(int((alive & counted).sum())), scored.append(int(counted.sum()))
    return hits, scored


def heldout(data_dir: str, out_path: str, steps: str, *drafters: str) -> None:
    """Score each NAME=DIR drafter on the converted store's held-out rows; write OUT.json."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    data = json.loads((Path(data_dir) / "conversion.json").read_text())
    rows = load_from_disk(data["rows"])
    argmax = load_file(data["heldout"])
    held = range(data["train_rows"], data["train_rows"] + data["eval_rows"])
    K, scores = int(steps), {}
    for spec in drafters:
        name, _, path = spec.partition("=")
        model, hits, scored, shown = load_drafter(path), [0] * K, [0] * K, time.time()
        for j, i in enumerate(held):
            hs = load_file(str(Path(data["hidden_states"]) / f"hs_{i}.safetensors"))
            h, s = row_hits(model, hs, rows[i]["loss_mask"], argmax[str(i)], K)
            hits, scored = [a + b for a, b in zip(hits, h)], [a + b for a, b in zip(scored, s)]
            if time.time() - shown > PROGRESS_S:
                shown = time.time()
                print(f"[peer] held-out {name}: {j + 1}/{len(held)} rows", flush=True)
        full = [h / s if s else math.nan for h, s in zip(hits, scored)]
        scores[name] = {"full_acc": full, "al_estimate": 1 + sum(full), "scored": scored}
        print(f"[peer] held-out {name}: " + " / ".join(f"{a:.3f}" for a in full), flush=True)
    record = {"drafters": {n: p for n, _, p in (d.partition("=") for d in drafters)}, "steps": K,
              "rows": len(held), "drafters_scores": scores}
    Path(out_path).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    commands = {"train": train, "heldout": heldout}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} train PLAN.json | heldout DATA_DIR OUT.json STEPS NAME=DIR ...")
    commands[sys.argv[1]](*sys.argv[2:])
