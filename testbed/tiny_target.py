"""How a tiny target is built and cached: the training loop, the bf16 save, and the build cache every testbed
artifact goes through (testbed/targets.py names them; ``fledge tiny-target``).

Under the testbed's root (default: the repo's .cache/tiny_target, gitignored):
    tokenizer/, data/   the chat tokenizer and the conversations every tiny target and recipe share
                        (testbed/tiny_writer.py: train, eval, eval_perturbed, long_eval)
    llama/              the tiny recipe's target (recipe=tiny), a LlamaForCausalLM + metrics.json
    moe/, mla/          the Qwen3-MoE- and DeepSeek-V3-shaped targets (recipe=tiny_moe, tiny_mla;
                        testbed/tiny_families.py), same tokenizer, stream and loss
    mla_mtp/            mla with DeepSeek-V3's MTP module, trained with it (testbed/tiny_mtp.py)
    long/, long_data/, long_eval/
                        the long-context target, its drafters' data and the AL-vs-context prompts
                        (recipe=tiny_long; testbed/tiny_long.py)
Every artifact carries a build.json holding a hash of its settings; a matching one means "done", so
re-running returns at once. Each is written to a temporary sibling and renamed, so a kill leaves nothing
half-written. Seeded and deterministic by step count (bitwise for the same thread count).

The models are trained and evaluated in fp32 on every CPU and saved in bf16: bf16 compute would be fast only
on CPUs with native bf16 (models/precision.py) and ~18x slower per step on AVX2-only ones, and it would make the
target (and every golden number downstream) depend on which CPU built it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

from fledge.atomic import atomic_path, read_json, write_json_atomic

# 2 was the first fp32 build of the stdlib targets; 3 is the first on the task language.
SCRIPT_VERSION = 3
SEED = 0


def default_root() -> Path:
    """``.cache/tiny_target`` under the working directory: where conf/target/tiny*.yaml look for it."""
    return Path.cwd() / ".cache" / "tiny_target"


def _key(**settings) -> str:
    blob = json.dumps({"script": SCRIPT_VERSION, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _done(path: Path, key: str) -> bool:
    meta = read_json(path / "build.json") if path.is_dir() else None
    return bool(meta) and meta.get("key") == key


def _cached(out: Path, key: str, build) -> Path:
    """Return ``out`` if its build.json holds ``key``; otherwise, under a lock (checked again inside),
    run ``build(tmp)`` to fill a temp dir, which returns extra build.json fields, and rename it to ``out``."""
    if _done(out, key):
        return out
    with _lock(out):
        if not _done(out, key):
            with atomic_path(out, "tiny-target", f"pass another --out, or delete {out} yourself") as tmp:
                tmp.mkdir()
                extra = build(tmp) or {}
                write_json_atomic(tmp / "build.json", {"key": key, **extra})
    return out


@contextlib.contextmanager
def _lock(path: Path):
    """One builder at a time per artifact (pytest sessions and the CLI may race for the same one); a
    family build does not block the Llama's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save_model(model, tok, path: Path) -> None:
    """bfloat16 on disk: what real hub targets ship, so the pipeline's dtype='auto' path is exercised."""
    model.generation_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, do_sample=False)
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)


def _lr_lambda(warmup: int, steps: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))  # cosine down to 10% of the peak
    return f


def lm_loss(model, x: torch.Tensor, mask: torch.Tensor, progress: float) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM on ids ``x`` [B, L + 1], weighted by ``mask`` [B, L]."""
    logits = model(input_ids=x[:, :-1]).logits
    w = mask.flatten().float()
    return (F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none") * w).sum() / w.sum()


def train_target(model, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float, warmup: int,
                 device: str = "cpu", seed: int = SEED, log_every: int = 50, loss_fn=lm_loss, **_budget):
    """Train the untrained ``model`` for ``steps`` AdamW steps on ``batches`` of (ids ``[B, L + 1]``, loss mask
    ``[B, L]``), the loss weighted by the mask, in fp32 on every CPU (no autocast: see the module docstring).
    ``loss_fn(model, ids, mask, progress)`` is the step's loss (default: next-token cross-entropy; progress is the
    share of steps done before this one). ``device="cuda"`` trains the same steps on a GPU (fp32, TF32 off): same
    data and initialisation, not bitwise the CPU build. Returns the model on the CPU. ``_budget`` takes a budget's
    other keys (seq_len, batch_size)."""
    torch.manual_seed(seed)
    model = model.to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup, steps))
    model.train()
    t0, loss_sum, n = time.time(), 0.0, 0
    for step in range(1, steps + 1):
        x, mask = (t.to(device) for t in next(batches))
        loss = loss_fn(model, x, mask, (step - 1) / steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_sum, n = loss_sum + loss.item(), n + 1
        if step % log_every == 0 or step == steps:
            el = time.time() - t0
            print(f"step {step}/{steps} loss {loss_sum / n:.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{el / step:.3f}s/step eta {el / step * (steps - step):.0f}s", flush=True)
            loss_sum, n = 0.0, 0
    return model.cpu()
