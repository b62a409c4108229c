"""The long-context tiny target (docs/long-context.md): the writer's language (testbed/tiny_tasks.py) with long
lookups mixed in, trained on 2,048-token windows, positions to 4,096.

    fledge tiny-target long [--out .cache/tiny_target] [--steps N]   (testbed/targets.py)

Writes, under ``<out>``:
    long/                     a LlamaForCausalLM of tiny_writer.MODEL's shape with 4,096 positions + metrics.json
                              (held-out loss / top-1 on answers; greedy distinct-3, non-degenerate and exact shares
                              per set and per context bucket; answer loss per context bucket)
    long_data/train.jsonl     drafter training conversations of the same stream, default layout (data=tiny_long)
    long_data/eval.jsonl      held-out conversations of that stream (recipe=tiny_long's eval_sources)
    long_eval/long_eval.jsonl the prompts of the AL-vs-context eval (eval.long_context_source): 4,100-5,000 tokens
                              of context, past the training windows, asking about the bottom lines only
The stream is tiny_tasks.mixed with a LONG_SHARE of tiny_tasks.long_task conversations (a directory lookup or a
ledger total over LONG_LINES lines, log-uniform, up to ~1,900 tokens), every layout, loss on answer tokens only.
The request is the first line of the user turn and the context one record a line, so evaluation/long_context.py
can cut a prompt to any bucket by dropping lines from the top; the long eval asks about the last lines, so the
answer is the same in every bucket and only the length of what precedes it changes.
Cached and atomic like testbed/tiny_writer.py (a build.json key per artifact), deterministic by step count.
"""

from __future__ import annotations

import bisect
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fledge.atomic import read_json, write_json_atomic
from fledge.models.precision import describe_cpu
from fledge.testbed import tiny_target as tt, tiny_tasks, tiny_writer

VERSION = 2  # 1: long tasks 15% of conversations, lines uniform in LONG_LINES
MODEL = dict(tiny_writer.MODEL, max_position_embeddings=4096)
BUDGET = dict(steps=420, seq_len=2048, batch_size=2, lr=3e-3, warmup=30)
# Long tasks: a LONG_SHARE of the conversations, of LONG_LINES lines drawn log-uniformly (many short lookups teach
# the copying, the long ones the reach; 195 lines: ~1,900 tokens, inside a 2,048-token window).
LONG_SHARE, LONG_LINES = 0.3, (8, 195)
N_TRAIN, N_EVAL = 800, 100
# Long eval: context past the training windows (>= 3,968 tokens, the top bucket), the record asked about among
# the last EVAL_TAIL lines.
N_LONG_EVAL, EVAL_LINES, EVAL_TAIL = 24, (440, 470), 8
BUCKETS = (256, 512, 1024, 2048, 3968)
N_PROMPTS, GEN_TOKENS = 8, 96  # greedy continuations scored per set and bucket


def stream(seed: int, layout: str | None = None) -> Iterator[dict]:
    """The long target's stream: tiny_tasks.mixed with a LONG_SHARE of long tasks (under ``layout``, or every
    layout)."""
    rng = random.Random(seed)
    while True:
        if rng.random() < LONG_SHARE:
            lo, hi = LONG_LINES
            yield tiny_tasks.long_task(rng, int(lo * (hi / lo) ** rng.random()), layout=layout)
        else:
            yield tiny_tasks.mixed(rng, layout)


def is_long(conv: dict) -> bool:
    return any(m["content"].startswith(("Directory of people.", "Ledger of sales.")) for m in conv["messages"])


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_long_data(root: Path | None = None) -> Path:
    """Write (once) ``<root>/long_data/{train,eval}.jsonl``: conversations of the long stream in the default
    layout (drafter training data and its held-out set; data=tiny_long)."""
    out = Path(root or tt.default_root()) / "long_data"
    key = tt._key(kind="long_data", version=VERSION, n=[N_TRAIN, N_EVAL], share=LONG_SHARE, lines=LONG_LINES)

    def build(tmp: Path) -> dict:
        s = stream(tt.SEED + 31, tiny_tasks.DEFAULT_LAYOUT)  # apart from the target's stream (seed + 21)
        rows = {"train": [next(s) for _ in range(N_TRAIN)], "eval": [next(s) for _ in range(N_EVAL)]}
        for name, convs in rows.items():
            _write(tmp / f"{name}.jsonl", convs)
        return {name: len(convs) for name, convs in rows.items()} | {"long_train": sum(map(is_long, rows["train"]))}

    return tt._cached(out, key, build)


def long_eval_conversations(seed: int, n: int = N_LONG_EVAL) -> list[dict]:
    """``n`` long tasks of EVAL_LINES lines (default layout, no system turn) asking about the last lines."""
    rng = random.Random(seed)
    return [tiny_tasks.long_task(rng, rng.randint(*EVAL_LINES), tail=EVAL_TAIL, layout=tiny_tasks.DEFAULT_LAYOUT,
                                 system=False) for _ in range(n)]


def build_long_eval(root: Path | None = None) -> Path:
    """Write (once) ``<root>/long_eval/long_eval.jsonl``, the prompts of the long-context eval."""
    out = Path(root or tt.default_root()) / "long_eval"
    key = tt._key(kind="long_eval", version=VERSION, n=N_LONG_EVAL, lines=EVAL_LINES, tail=EVAL_TAIL)

    def build(tmp: Path) -> dict:
        _write(tmp / "long_eval.jsonl", long_eval_conversations(tt.SEED + 41))
        return {"rows": N_LONG_EVAL}

    return tt._cached(out, key, build)


def encoder(tok):
    """``encode(conv, upto)``: the prompt ids of ``conv["messages"][:upto]`` + the generation prompt, as
    evaluation/long_context.py ``cut_to`` wants."""
    def encode(conv: dict, upto: int) -> list[int]:
        text = tok.apply_chat_template(conv["messages"][:upto], add_generation_prompt=True, tokenize=False,
                                       **(conv.get("template_kwargs") or {}))
        return tok(text, add_special_tokens=False)["input_ids"]
    return encode


def cut(conv: dict, encode, tokens: int) -> list[int]:
    """The prompt ids of ``conv`` with the fewest lines dropped from the top of its first user turn (its first
    line, the request, kept) that fit ``tokens``: evaluation/long_context.py ``cut_to``'s rule (the testbed sits
    below evaluation), for the metrics."""
    first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "user")
    head, *lines = conv["messages"][first]["content"].split("\n")
    upto = len(conv["messages"]) - 1

    def prompt(drop: int) -> list[int]:
        msgs = [dict(m) for m in conv["messages"]]
        msgs[first]["content"] = "\n".join([head, *lines[drop:]])
        return encode({**conv, "messages": msgs}, upto)

    return prompt(bisect.bisect_left(range(len(lines) + 1), True, key=lambda d: len(prompt(d)) <= tokens))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _greedy(model, tok, prompts: list[list[int]], answers: list[str]) -> dict:
    return tiny_writer.greedy_stats(model, tok, prompts, answers, GEN_TOKENS)


def _answer_loss(model, tok, prompts: list[list[int]], answers: list[str]) -> dict:
    """Teacher-forced loss / top-1 on the answer tokens (and the end token) after each prompt."""
    import torch.nn.functional as F

    nll, correct, count = 0.0, 0, 0
    for ids, answer in zip(prompts, answers):
        ans = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        logits = model(input_ids=torch.tensor([ids + ans])).logits[0, len(ids) - 1: -1]
        nll += F.cross_entropy(logits, torch.tensor(ans), reduction="sum").item()
        correct += (logits.argmax(-1) == torch.tensor(ans)).sum().item()
        count += len(ans)
    return {"loss": nll / count, "top1": correct / count}


@torch.no_grad()
def evaluate(path: Path, data_dir: Path, long_eval: Path) -> dict:
    """Held-out loss / top-1 on answers (long_data/eval.jsonl); greedy distinct-3, non-degenerate and exact
    shares on its short and long conversations; per context bucket of the long eval, the same greedy figures and
    the answer's loss / top-1 (fp32 from the bf16 weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    encode = encoder(tok)
    convs = _read(data_dir / "eval.jsonl")
    out: dict = {}
    prompts = [tiny_writer._render(tok, c, True) for c in convs]
    answers = [c["messages"][-1]["content"] for c in convs]
    whole = _answer_loss(model, tok, prompts, answers)  # the last answer of each conversation
    out.update(heldout_loss=whole["loss"], heldout_top1=whole["top1"])
    for name, keep in (("short", lambda c: not is_long(c)), ("long", is_long)):
        sel = [i for i, c in enumerate(convs) if keep(c)][:N_PROMPTS]
        out[name] = _greedy(model, tok, [prompts[i] for i in sel], [answers[i] for i in sel])
    rows = _read(long_eval)[:N_PROMPTS]
    answers = [c["messages"][-1]["content"] for c in rows]
    out["buckets"] = {}
    for b in BUCKETS:
        cuts = [cut(c, encode, b) for c in rows]
        out["buckets"][b] = _greedy(model, tok, cuts, answers) | {"answer": _answer_loss(model, tok, cuts, answers)}
    return out


def build_long_target(root: Path | None = None, steps: int | None = None, device: str = "cpu") -> Path:
    """Build (once) the long target; returns its from_pretrained directory (``<root>/long``)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    settings = dict(BUDGET, **({"steps": steps} if steps else {}))
    tok_dir, data_dir, eval_dir = tiny_writer.build_tokenizer(root), build_long_data(root), build_long_eval(root)
    out = Path(root or tt.default_root()) / "long"
    key = tt._key(kind="long_target", version=VERSION, budget=settings, model=MODEL, seed=tt.SEED,
                  share=LONG_SHARE, lines=LONG_LINES, tok=read_json(tok_dir / "build.json")["key"],
                  data=read_json(data_dir / "build.json")["key"], eval=read_json(eval_dir / "build.json")["key"])

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tok_dir)
        m = dict(MODEL)
        rope = {"rope_type": "default", "rope_theta": m.pop("rope_theta")}
        torch.manual_seed(tt.SEED)
        model = LlamaForCausalLM(LlamaConfig(**m, rope_parameters=rope, bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        t0, c0 = time.time(), time.process_time()
        batches = tiny_writer._batches(tok, stream(tt.SEED + 21), settings["seq_len"], settings["batch_size"])
        model = tt.train_target(model, batches, **settings, device=device)
        train_s, train_cpu = time.time() - t0, time.process_time() - c0
        tt._save_model(model, tok, tmp)
        metrics = evaluate(tmp, data_dir, eval_dir / "long_eval.jsonl")
        metrics.update(budget="long", **settings, long_share=LONG_SHARE, long_lines=LONG_LINES,
                       train_seconds=round(train_s, 1), train_cpu_seconds=round(train_cpu, 1),
                       torch_threads=torch.get_num_threads(), compute_dtype="float32", cpu=describe_cpu(),
                       train_device=device, parameters=sum(p.numel() for p in model.parameters()))
        write_json_atomic(tmp / "metrics.json", metrics)

    return tt._cached(out, key, build)
