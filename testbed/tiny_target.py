"""Build the tiny real targets: small causal LMs and a BPE chat tokenizer trained on the stdlib's source.

    fledge tiny-target --budget quick|testbed|long [--family llama|moe|mla] [--out .cache/tiny_target] [--device
    cpu|cuda]

Writes, under ``--out`` (default: the repo's .cache/tiny_target, gitignored):
    data/{train,eval}.jsonl   the tiny recipes' conversations (OpenAI ``messages`` form)
    long_eval/long_eval.jsonl continuations from deep inside long held-out files (testbed/tiny_long.py): the
                              prompts of the AL-vs-context-length eval (eval.long_context_source)
    long_data/train.jsonl     (--budget long) drafter training conversations from the long target's stream,
                              half of them whole files (data=tiny_long, recipe=tiny_long)
    tokenizer/                the BPE tokenizer with its chat template (cached apart: seconds to build)
    <budget>/                 the tiny Llama (LlamaForCausalLM) + metrics.json
    <family>-<budget>/        the tiny MoE (Qwen3MoeForCausalLM) or MLA (DeepseekV3ForCausalLM) target
All families share the data and the tokenizer (testbed/tiny_families.py holds the MoE and MLA shapes).
Every artifact carries a build.json holding a hash of its settings; a matching one means "done", so
re-running returns at once. Each is written to a temporary sibling and renamed, so a kill leaves nothing
half-written. Seeded and deterministic by step count (bitwise only for the same thread count).

The model is trained and evaluated in fp32 on every CPU and saved in bf16: bf16 compute would be fast only
on CPUs with native bf16 (models/precision.py) and ~18x slower per step on AVX2-only ones, and it would make the
target (and every golden number downstream) depend on which CPU built it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

from fledge.atomic import atomic_path, read_json, write_json_atomic
from fledge.models.precision import describe_cpu
from fledge.testbed import tiny_corpus, tiny_families, tiny_long

SCRIPT_VERSION = 1
# Part of the target's cache key only (data and tokenizer builds are unchanged by it): 1 was trained under
# bf16 autocast, 2 in fp32; a build of the other kind is rebuilt, never reused.
TARGET_VERSION = 2
SEED = 0
N_TRAIN, N_EVAL = 2000, 100
N_PROMPTS, GEN_TOKENS = 16, 64  # greedy continuations scored for distinct-3-grams

# 8 layers so the aux ids (2, L//2, L-3) = (2, 4, 5) are distinct; GQA and an untied head like real targets.
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)

# Step counts (not wall time) fix each budget, so builds are deterministic; see recipes/tiny/README.md
# for the time on 2 cores (fp32 on every CPU, so about the same on AVX2-only and native-bf16 CPUs).
BUDGETS = {
    "quick": dict(steps=120, seq_len=512, batch_size=4, lr=2e-3, warmup=12),
    "testbed": dict(steps=560, seq_len=512, batch_size=8, lr=2e-3, warmup=40),
    # Long context (docs/long-context.md, testbed/tiny_long.py): 2,048-token rows, half of the conversations whole
    # files, positions to 4,096. Fewer tokens than testbed (1.0M vs 2.3M) since a 2K row costs more per token.
    "long": dict(steps=240, seq_len=2048, batch_size=2, lr=2e-3, warmup=24, long_share=0.5),
}
# Per-budget changes to MODEL (part of that budget's cache key only).
MODEL_FOR = {"long": dict(max_position_embeddings=4096)}
LONG_EVAL_SEED = 7
# Training conversations for drafters of the long target (recipe=tiny_long): the long budget's mixed stream
# (half whole files) drawn with the data seed, as build_data draws the quick recipe's from the target's stream.
N_LONG_TRAIN = 400


def default_root() -> Path:
    """``.cache/tiny_target`` under the working directory: where conf/target/tiny.yaml looks for it."""
    return Path.cwd() / ".cache" / "tiny_target"


@functools.lru_cache(maxsize=1)
def _stdlib_signature() -> str:
    """Cheap identity of the stdlib the corpus comes from (Python version + file names and sizes)."""
    root = tiny_corpus.stdlib_dir()
    h = hashlib.sha256(platform.python_version().encode())
    for p in sorted(root.rglob("*.py")):
        h.update(f"{p.relative_to(root)}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _key(**settings) -> str:
    blob = json.dumps({"script": SCRIPT_VERSION, "stdlib": _stdlib_signature(), **settings}, sort_keys=True)
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
            with atomic_path(out) as tmp:
                tmp.mkdir()
                extra = build(tmp) or {}
                write_json_atomic(tmp / "build.json", {"key": key, **extra})
    return out


@contextlib.contextmanager
def _lock(path: Path):
    """One builder at a time per artifact (pytest sessions and the CLI may race for the same one); a
    testbed build does not block a quick one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_data(root: Path | None = None) -> Path:
    """Write (once) ``root/data/{train,eval}.jsonl``; returns the data directory."""
    out = Path(root or default_root()) / "data"
    key = _key(kind="data", seed=SEED, n_train=N_TRAIN, n_eval=N_EVAL)

    def build(tmp: Path) -> dict:
        train_files, eval_files = tiny_corpus.split_sources(tiny_corpus.list_sources())
        stream = tiny_corpus.conversation_stream(train_files, SEED)
        rows = {"train": [next(stream) for _ in range(N_TRAIN)],
                "eval": tiny_corpus.eval_conversations(eval_files, N_EVAL, SEED + 1)}
        for name, convs in rows.items():
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in convs))
        return {"train_modules": [f.path for f in train_files], "eval_modules": [f.path for f in eval_files],
                "n_train": N_TRAIN, "n_eval": N_EVAL}

    return _cached(out, key, build)


def build_tokenizer(root: Path | None = None) -> Path:
    """Train (once) the byte-level BPE chat tokenizer on the train modules; returns its directory."""
    out = Path(root or default_root()) / "tokenizer"
    key = _key(kind="tokenizer", vocab=MODEL["vocab_size"], template=tiny_corpus.CHAT_TEMPLATE)

    def build(tmp: Path) -> None:
        train_files, _ = tiny_corpus.split_sources(tiny_corpus.list_sources())
        tiny_corpus.train_tokenizer(train_files, MODEL["vocab_size"]).save_pretrained(tmp)

    return _cached(out, key, build)


def _llama_config(tok, **overrides):
    from transformers import LlamaConfig

    m = dict(MODEL, **overrides)
    rope = {"rope_type": "default", "rope_theta": m.pop("rope_theta")}
    return LlamaConfig(**m, rope_parameters=rope, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _new_model(tok, family: str, overrides: dict | None = None):
    """An untrained causal LM of the tiny ``family`` (llama: the tiny recipe's, with the budget's config
    ``overrides``; moe, mla: tiny_families)."""
    if family == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(_llama_config(tok, **(overrides or {})))
    return tiny_families.new_model(family, tok)


def _save_model(model, tok, path: Path) -> None:
    """bfloat16 on disk: what real hub targets ship, so the pipeline's dtype='auto' path is exercised."""
    model.generation_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, do_sample=False)
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)


def save_random_target(out: Path, root: Path | None = None, seed: int = SEED) -> Path:
    """Save an untrained Llama of the tiny target's shape with the same tokenizer (seconds; for tests of
    mechanics that do not need a learned target)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(build_tokenizer(root))
    torch.manual_seed(seed)
    _save_model(LlamaForCausalLM(_llama_config(tok)), tok, Path(out))
    return Path(out)


def _batches(tok, files, seed: int, seq_len: int, batch_size: int, long_share: float = 0.0,
             stream: Iterator[dict] | None = None) -> Iterator[torch.Tensor]:
    """(batch, seq_len + 1) windows of chat-rendered conversations packed end to end (with ``long_share``
    of them whole files: testbed/tiny_long.py); ``stream`` replaces the stdlib conversations (each rendered
    with its own ``template_kwargs``: testbed/tiny_writer.py)."""

    if stream is None:
        stream = (tiny_long.mixed_stream(files, seed, long_share) if long_share
                  else tiny_corpus.conversation_stream(files, seed))
    buf: list[int] = []
    rows: list[list[int]] = []
    while True:
        convs = [next(stream) for _ in range(64)]
        texts = [tok.apply_chat_template(c["messages"], tokenize=False, **(c.get("template_kwargs") or {}))
                 for c in convs]
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            buf.extend(ids)
        while len(buf) > seq_len:
            rows.append(buf[: seq_len + 1])
            buf = buf[seq_len + 1:]
            if len(rows) == batch_size:
                yield torch.tensor(rows)
                rows = []


def _lr_lambda(warmup: int, steps: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))  # cosine down to 10% of the peak
    return f


def train_target(tok, files, steps: int, seq_len: int, batch_size: int, lr: float, warmup: int,
                 seed: int = SEED, log_every: int = 50, long_share: float = 0.0, model_overrides: dict | None = None,
                 device: str = "cpu", family: str = "llama", stream: Iterator[dict] | None = None,
                 model=None, batches: Iterator | None = None):
    """Train a tiny target of ``family`` from scratch on chat-rendered conversations, in fp32 on every CPU (no
    autocast: see the module docstring). ``device="cuda"`` trains the same steps on a GPU (fp32, TF32 off):
    same data and initialisation, not bitwise the CPU build; the model is returned on the CPU. ``stream`` and
    ``model`` (an untrained one) replace the stdlib conversations and the family's model; ``batches`` (of
    ``(ids, loss mask)`` pairs, the mask one shorter than the row) replaces the packing and weights the loss."""
    torch.manual_seed(seed)
    model = (model if model is not None else _new_model(tok, family, model_overrides)).to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup, steps))
    batches = batches or _batches(tok, files, seed + 1, seq_len, batch_size, long_share, stream)
    model.train()
    t0, loss_sum, n = time.time(), 0.0, 0
    for step in range(1, steps + 1):
        b = next(batches)
        x, mask = (b[0].to(device), b[1].to(device)) if isinstance(b, tuple) else (b.to(device), None)
        logits = model(input_ids=x[:, :-1]).logits
        if mask is None:
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        else:
            w = mask.flatten().float()
            loss = (F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none") * w).sum() / w.sum()
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


@torch.no_grad()
def evaluate_target(path: Path, eval_jsonl: Path) -> dict:
    """Held-out loss / top-1 over assistant tokens of eval conversations, and distinct-3-gram ratio
    of greedy continuations of the first N_PROMPTS eval prompts (cut from the middle of files). Computed in
    fp32 from the bf16 weights, so the figures do not depend on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    convs = [json.loads(line) for line in eval_jsonl.read_text().splitlines()]
    nll, correct, count = 0.0, 0, 0
    for i in range(0, len(convs), 10):
        enc = tok.apply_chat_template([c["messages"] for c in convs[i:i + 10]], return_dict=True, padding=True,
                                      return_assistant_tokens_mask=True, return_tensors="pt")
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, :-1].float()
        mask = enc["assistant_masks"][:, 1:].bool()  # position t predicts token t+1
        target = enc["input_ids"][:, 1:]
        nll += F.cross_entropy(logits[mask], target[mask], reduction="sum").item()
        correct += (logits[mask].argmax(-1) == target[mask]).sum().item()
        count += int(mask.sum())
    prompts = tok.apply_chat_template([c["messages"][:-1] for c in convs[:N_PROMPTS]], add_generation_prompt=True,
                                      return_dict=True, padding=True, return_tensors="pt")
    gen = model.generate(**prompts, max_new_tokens=GEN_TOKENS, do_sample=False)[:, prompts["input_ids"].shape[1]:]
    ratios, samples, lengths = [], [], []
    for row in gen.tolist():
        out = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        grams = list(zip(out, out[1:], out[2:]))
        ratios.append(len(set(grams)) / max(1, len(grams)))
        samples.append(tok.decode(out))
        lengths.append(len(out))
    return {"heldout_loss": nll / count, "heldout_top1": correct / count, "heldout_tokens": count,
            "distinct3": sum(ratios) / len(ratios), "greedy_samples": samples[:4],
            "mean_greedy_tokens": sum(lengths) / len(lengths)}


def build_tiny_target(budget: str = "quick", root: Path | None = None, steps: int | None = None,
                      device: str = "cpu", family: str = "llama") -> Path:
    """Build (once) the ``budget`` target of ``family`` under ``root``; returns its from_pretrained directory.
    ``steps`` overrides the budget's step count (smoke tests); it is part of the cache key. ``device``
    (cpu | cuda) is not: it is recorded in metrics.json."""
    families = ("llama", *tiny_families.SHAPES)
    if family not in families:
        raise ValueError(f"--family {family!r}: expected one of {list(families)}")
    budgets = BUDGETS if family == "llama" else tiny_families.BUDGETS
    if budget not in budgets:
        raise ValueError(f"--budget {budget!r}: expected one of {sorted(budgets)} for --family {family}")
    settings = dict(budgets[budget], **({"steps": steps} if steps else {}))
    root = Path(root or default_root())
    data_dir, tok_dir = build_data(root), build_tokenizer(root)
    out = root / (budget if family == "llama" else f"{family}-{budget}")
    # The Llama's key is unchanged by the other families (its cached builds stay valid).
    shape = ({"model": dict(MODEL, **MODEL_FOR.get(budget, {}))} if family == "llama"
             else {"family": family, "model": tiny_families.SHAPES[family]})
    key = _key(kind="target", version=TARGET_VERSION, budget=settings, **shape, seed=SEED,
               data=read_json(data_dir / "build.json")["key"], tok=read_json(tok_dir / "build.json")["key"])

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        train_files, _ = tiny_corpus.split_sources(tiny_corpus.list_sources())
        t0, c0 = time.time(), time.process_time()
        model = train_target(tok, train_files, **settings, model_overrides=MODEL_FOR.get(budget) if family == "llama"
                             else None, device=device, family=family)
        train_s, train_cpu = time.time() - t0, time.process_time() - c0
        _save_model(model, tok, tmp)
        metrics = evaluate_target(tmp, data_dir / "eval.jsonl")
        metrics.update(budget=budget, family=family, **settings, train_seconds=round(train_s, 1),
                       train_cpu_seconds=round(train_cpu, 1),
                       wall_seconds=round(time.time() - t0, 1), torch_threads=torch.get_num_threads(),
                       train_device=device if device == "cpu" else torch.cuda.get_device_name(),
                       compute_dtype="float32", cpu=describe_cpu(),
                       parameters=sum(p.numel() for p in model.parameters()))
        if budget == "long":
            metrics["position_loss"] = long_position_loss(tmp, root)
        write_json_atomic(tmp / "metrics.json", metrics)

    return _cached(out, key, build)


def build_long_eval(root: Path | None = None) -> Path:
    """Write (once) ``root/long_eval/long_eval.jsonl``: continuations from deep inside long held-out
    stdlib files (testbed/tiny_long.py), the prompts of the long-context eval (``eval.long_context_source``)."""

    out = Path(root or default_root()) / "long_eval"
    key = _key(kind="long_eval", seed=LONG_EVAL_SEED, min_chars=tiny_long.LONG_EVAL_MIN_CONTEXT_CHARS,
               cuts=tiny_long.LONG_EVAL_CUTS_PER_FILE, answer=tiny_long.LONG_EVAL_ANSWER_CHARS)

    def build(tmp: Path) -> dict:
        return {"rows": tiny_long.write_long_eval(tmp / "long_eval.jsonl", LONG_EVAL_SEED)}

    return _cached(out, key, build)


def build_long_data(root: Path | None = None) -> Path:
    """Write (once) ``root/long_data/train.jsonl``: N_LONG_TRAIN conversations of the stream the long target
    trained on (testbed/tiny_long.py mixed_stream, the long budget's long_share), conf/data/tiny_long.yaml's
    sources. Apart from the target's build, so its key (and a built long target) is unchanged by it."""

    out = Path(root or default_root()) / "long_data"
    share = BUDGETS["long"]["long_share"]
    key = _key(kind="long_data", seed=SEED, n=N_LONG_TRAIN, long_share=share, doc_chars=tiny_long.LONG_DOC_CHARS)

    def build(tmp: Path) -> dict:
        train_files, _ = tiny_corpus.split_sources(tiny_corpus.list_sources())
        return tiny_long.write_long_train(tmp / "train.jsonl", train_files, SEED, share, N_LONG_TRAIN)

    return _cached(out, key, build)


POSITION_EDGES = (0, 256, 512, 1024, 2048, 4096)


@torch.no_grad()
def long_position_loss(path: Path, root: Path | None = None) -> dict:
    """Held-out loss of the target in ``path`` per position bucket over the long eval files (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    convs = [json.loads(line) for line in (build_long_eval(root) / "long_eval.jsonl").read_text().splitlines()]
    first = {}
    for c in convs:  # one conversation per file: the one with the most context
        if c["source"] not in first or c["cut_line"] > first[c["source"]]["cut_line"]:
            first[c["source"]] = c
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return tiny_long.position_loss(model, tok, list(first.values()), POSITION_EDGES, POSITION_EDGES[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="quick", choices=sorted(BUDGETS))
    ap.add_argument("--family", default="llama", choices=["llama", *tiny_families.SHAPES],
                    help="llama (recipe=tiny), moe (Qwen3-MoE-shaped: recipe=tiny_moe), mla (DeepSeek-V3-shaped: "
                         "recipe=tiny_mla); moe and mla have only the quick budget")
    ap.add_argument("--out", type=Path, default=default_root())
    ap.add_argument("--steps", type=int, default=None, help="override the budget's step count (smoke tests)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="train on this device (cuda: the same steps in fp32 on a GPU, minutes instead of ~30)")
    args = ap.parse_args(argv)
    path = build_tiny_target(args.budget, args.out, args.steps, args.device, args.family)
    print(f"long-context eval prompts (eval.long_context_source): {build_long_eval(args.out) / 'long_eval.jsonl'}")
    if args.budget == "long":
        long_data = build_long_data(args.out) / "train.jsonl"
        print(f"long training conversations (data=tiny_long, recipe=tiny_long): {long_data}")
    m = read_json(path / "metrics.json")
    print(f"{path}: held-out loss {m['heldout_loss']:.3f}, top-1 {m['heldout_top1']:.1%}, "
          f"distinct-3 {m['distinct3']:.2f}, {m['steps']} steps in {m['wall_seconds']:.0f}s, "
          f"{m['parameters'] / 1e6:.1f}M params")


if __name__ == "__main__":
    main()
