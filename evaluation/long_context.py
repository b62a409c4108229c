"""Acceptance as a function of context length (docs/long-context.md): the same conversations cut to each
context-length bucket, so the length of the context is the only thing that changes between buckets.

``eval.context_buckets`` lists prompt lengths in tokens. The prompts come from ``eval.long_context_source``
(a jsonl of conversations whose first user turn holds a long context: for the tiny target,
``fledge tiny-target`` writes continuations from deep inside long held-out standard-library files), or,
without one, from the eval conversations grown with held-out context (as the ``long`` set is). Only
conversations whose full prompt reaches the largest bucket are used, each in every bucket: the first line
of the first user turn (the request) is kept and whole lines are dropped after it, from the top of the
context, until the prompt fits the bucket. The next tokens to generate are the same in every bucket.

The eval stage (evaluation/evaluate.py) runs the set harness and the drift probe on each bucket; this module
builds the prompts and keeps the per-bucket summary the report and ``fledge compare`` read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from fledge.atomic import read_jsonl

log = logging.getLogger(__name__)


def _with_context(conv: dict, first: int, head: str, lines: Sequence[str], drop: int) -> dict:
    msgs = [dict(m) for m in conv["messages"]]
    msgs[first]["content"] = "\n".join([head, *lines[drop:]])
    return {**conv, "messages": msgs}


def cut_to(conv: dict, upto: int, encode: Callable[[dict, int], list[int]], tokens: int) -> list[int] | None:
    """The prompt ids of ``conv`` (``messages[:upto]`` + generation prompt) with whole lines dropped from the
    top of its first user turn's context (its first line kept) until it has <= ``tokens`` tokens and as many
    as possible; None when even the request alone is longer."""
    first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "user")
    head, *lines = conv["messages"][first]["content"].split("\n")
    lo, hi = 0, len(lines)  # drop lo lines: too long; find the fewest drops that fit
    if len(encode(conv, upto)) <= tokens:
        return encode(conv, upto)
    if len(encode(_with_context(conv, first, head, lines, hi), upto)) > tokens:
        return None
    while hi - lo > 1:  # invariant: dropping lo lines is too long, dropping hi lines fits
        mid = (lo + hi) // 2
        if len(encode(_with_context(conv, first, head, lines, mid), upto)) > tokens:
            lo = mid
        else:
            hi = mid
    return encode(_with_context(conv, first, head, lines, hi), upto)


def bucket_prompts(convs: Sequence[dict], prompt_upto: Callable[[dict], int], encode: Callable[[dict, int], list[int]],
                   buckets: Sequence[int], n: int) -> dict[int, list[list[int]]]:
    """{bucket: prompt ids} for the first ``n`` conversations whose prompt reaches the largest bucket (each
    cut to every bucket; a cut lands within a line's tokens of the bucket)."""
    top = max(buckets)
    chosen: list[dict] = []
    for conv in convs:
        if len(chosen) == n:
            break
        if len(encode(conv, prompt_upto(conv))) >= top:
            chosen.append(conv)
    if len(chosen) < n:
        log.warning("eval.context_buckets: only %d of %d conversations reach %d prompt tokens", len(chosen), n, top)
    out: dict[int, list[list[int]]] = {b: [] for b in buckets}
    for conv in chosen:
        cuts = [cut_to(conv, prompt_upto(conv), encode, b) for b in buckets]
        if any(c is None for c in cuts):
            continue
        for b, ids in zip(buckets, cuts):
            out[b].append(ids)
    return out


def check_long_source(path: str, key: str = "eval.long_context_source", hint: str = "") -> None:
    """ValueError naming ``key`` and the fix when ``path`` does not exist (``hint``: the caller's way to make
    it, e.g. the testbed's build command)."""
    if not Path(path).exists():
        raise ValueError(f"{key}={path}: no such file; " + (f"{hint}, or point" if hint else "point")
                         + " it at a jsonl of conversations with a long first user turn")


def read_long_source(path: str, key: str = "eval.long_context_source") -> list[dict]:
    """The conversations of a jsonl file; a missing file is a ValueError naming ``key`` and the fix."""
    check_long_source(path, key)
    return read_jsonl(path, f"fix or regenerate {key}")


def summarize(bucket: int, result: dict, drift: dict) -> dict:
    """What the report keeps of one bucket: the set harness's headline figures and the drift curves."""
    d, lk = result["drafter"], result["lookup"]
    return {"bucket": bucket, "prompts": result["prompts"], "prompt_tokens_mean": result["prompt_tokens_mean"],
            "al": d["al"], "lookup_al": lk["al"], "accept_at": d["accept_at"],
            "al_non_degenerate": result["drafter_non_degenerate"]["al"], "distinct3": result["distinct3_mean"],
            "greedy_ties": result["greedy_ties"], "drift": drift,
            # eval.temperature > 0: AL of the same prompts with rejection sampling (None when greedy only)
            "al_sampled": result["drafter_sampled"]["al"] if "drafter_sampled" in result else None}


def drift_at(s: dict, key: str, depth: str = "deep") -> float:
    """A bucket's drift figure: at depth 0 (``first``) or averaged over the fed-back depths (``deep``)."""
    vals = s["drift"][key]
    if depth == "first" or len(vals) == 1:
        return vals[0]
    return sum(vals[1:]) / len(vals[1:])
