"""Long context for the tiny testbed (docs/long-context.md): whole-file training documents, a long-prompt eval split
built from long held-out standard-library files, and a per-position held-out loss that says whether a
target uses context beyond what it was trained on.

The tiny target's chat data (tiny_corpus.py) is cut into answers of ~1,100 characters, so a target trained
on it never needs more than a few hundred tokens of context. The ``long`` build (tiny_target.py) mixes in
*whole files* asked for by name: code whose later lines depend on names defined thousands of tokens
earlier. The long eval split asks to continue a held-out file from deep inside it, with everything before
the cut as the prompt; ``evaluation/long_context.py`` cuts those prompts to each context-length bucket.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from fledge.testbed import tiny_corpus
from fledge.testbed.tiny_corpus import SourceFile

# ~3 characters per token: 14,000 characters is ~4,500 tokens, past the long target's 2,048-token rows.
LONG_DOC_CHARS = 14000
LONG_EVAL_MIN_CONTEXT_CHARS = 13000  # every long-eval prompt has at least this much of its file before the cut
LONG_EVAL_CUTS_PER_FILE = 3
LONG_EVAL_ANSWER_CHARS = 600
_ASK_WHOLE = ["Show me the source of `{mod}`.", "Print {path}.", "Paste the whole of {path}."]
_ASK_CONTINUE_LONG = "Continue this file ({path}):\n{snippet}"


def whole_file(rng: random.Random, f: SourceFile) -> dict:
    """A conversation whose answer is the file from its top (up to LONG_DOC_CHARS characters)."""
    text, _ = tiny_corpus._take(f.lines, 0, LONG_DOC_CHARS)
    ask = rng.choice(_ASK_WHOLE).format(mod=f.module, path=f.path)
    return {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]}


def mixed_stream(files: list[SourceFile], seed: int, long_share: float) -> Iterator[dict]:
    """The tiny chat conversations with a ``long_share`` of whole-file conversations mixed in (seeded)."""
    rng = random.Random(seed)
    big = [f for f in files if sum(len(line) + 1 for line in f.lines) >= LONG_DOC_CHARS // 2]
    while True:
        if rng.random() < long_share:
            yield whole_file(rng, rng.choice(big))
        else:
            yield tiny_corpus.conversation(rng, files)


def write_long_train(path: Path, files: list[SourceFile], seed: int, long_share: float, n: int) -> dict:
    """Write ``n`` conversations of ``mixed_stream`` (jsonl, the tiny recipe's ``messages`` form): training
    data for drafters of the long target, from the distribution it was trained on. Returns counts for build.json."""
    stream = mixed_stream(files, seed, long_share)
    rows = [next(stream) for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chars = [sum(len(m["content"]) for m in r["messages"]) for r in rows]
    return {"rows": n, "chars": sum(chars), "rows_over_6000_chars": sum(c > 6000 for c in chars)}


def long_eval_conversations(files: list[SourceFile], seed: int) -> list[dict]:
    """Continuations of held-out ``files`` from deep inside them: the user turn holds the file from its top
    to the cut (>= LONG_EVAL_MIN_CONTEXT_CHARS), the assistant turn the next LONG_EVAL_ANSWER_CHARS. Up to
    LONG_EVAL_CUTS_PER_FILE cuts per long file, round-robin over files so no file dominates."""
    rng = random.Random(seed)
    per_file = []
    for f in files:
        starts = [0]
        for line in f.lines:
            starts.append(starts[-1] + len(line) + 1)
        ok = [i for i in range(len(f.lines) - 5) if starts[i] >= LONG_EVAL_MIN_CONTEXT_CHARS and f.lines[i].strip()]
        if not ok:
            continue
        cuts = sorted(rng.sample(ok, min(LONG_EVAL_CUTS_PER_FILE, len(ok))))
        convs = []
        for cut in cuts:
            answer, _ = tiny_corpus._take(f.lines, cut, LONG_EVAL_ANSWER_CHARS)
            snippet = "\n".join(f.lines[:cut])
            ask = _ASK_CONTINUE_LONG.format(path=f.path, snippet=snippet)
            convs.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}],
                          "source": f.path, "cut_line": cut})
        per_file.append(convs)
    out = []
    for r in range(LONG_EVAL_CUTS_PER_FILE):
        out += [convs[r] for convs in per_file if r < len(convs)]
    return out


def write_long_eval(path: Path, seed: int) -> int:
    """Write the long eval split (jsonl) for the stdlib's held-out modules; returns its row count."""
    _, held = tiny_corpus.split_sources(tiny_corpus.list_sources())
    rows = long_eval_conversations(held, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


@torch.no_grad()
def position_loss(model, tok, convs: Sequence[dict], edges: Sequence[int], max_tokens: int) -> dict:
    """Held-out next-token loss of ``model`` over the chat-rendered ``convs`` (each cut to ``max_tokens``),
    averaged per position bucket [edges[i], edges[i+1]): a target that uses long context has a lower loss
    far into a file than near its top; one trained on short rows gets worse past its training length."""
    sums = torch.zeros(len(edges) - 1, dtype=torch.float64)
    counts = torch.zeros(len(edges) - 1, dtype=torch.float64)
    for c in convs:
        ids = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"][:max_tokens]
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].float()
        nll = F.cross_entropy(logits, x[0, 1:], reduction="none").double()
        pos = torch.arange(1, len(ids))
        for b in range(len(edges) - 1):
            sel = (pos >= edges[b]) & (pos < edges[b + 1])
            sums[b] += nll[sel].sum()
            counts[b] += sel.sum()
    return {"edges": list(edges), "loss": [float(s / c) if c else None for s, c in zip(sums, counts)],
            "tokens": [int(c) for c in counts]}
