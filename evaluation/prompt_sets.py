"""The eval stage's prompts: every prompt set of ``eval.sets`` and the context-length buckets, as token ids.

The built-in sets come from the prepare stage's held-out splits: ``default`` (the eval conversations),
``perturbed`` (its perturbed templates), ``long`` (the eval conversations grown with more held-out context,
:func:`lengthen`) and the template perturbations of evaluation/perturbations.py. The named public benchmarks
(evaluation/eval_sets.py) are loaded by hub id or from ``eval.set_paths``. A prompt is the conversation up to
and including its last user turn, rendered with the generation prompt, so the target answers that turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from fledge.atomic import read_jsonl
from fledge.conf.schema import EvalConfig
from fledge.data.prepare.chat import ChatRenderer, prompt_ids
from fledge.evaluation import long_context
from fledge.evaluation.eval_sets import EVAL_SETS, check_set_names, load_conversations, render_prompts
from fledge.evaluation.perturbations import PERTURBATIONS, perturbed
from fledge.run_layout import PrepareDir

log = logging.getLogger(__name__)
# The prepare stage's eval split each built-in set's prompts come from.
SET_SPLITS = {"default": "eval", "perturbed": "eval_perturbed", "long": "eval", **{p: "eval" for p in PERTURBATIONS}}


def read_conversations(path: Path) -> list[dict]:
    return read_jsonl(path, "re-run the prepare stage")


def prompt_upto(conv: dict) -> int:
    """messages[:last_user + 1]: the prompt the target answers last."""
    users = [i for i, m in enumerate(conv["messages"]) if m["role"] == "user"]
    if not users:
        raise ValueError(f"eval conversation {conv.get('source')}:{conv.get('index')} has no user turn")
    return users[-1] + 1


def lengthen(conv: dict, others: Sequence[dict], renderer: ChatRenderer, want_tokens: int) -> dict:
    """A copy of ``conv`` whose first user turn is prefixed with held-out text (the assistant answers of
    ``others``) until the prompt reaches about ``want_tokens`` tokens."""

    upto = prompt_upto(conv)
    first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "user")
    pieces, out = [], conv
    for o in others:
        pieces += [m["content"] for m in o["messages"] if m["role"] == "assistant" and m.get("content")]
        msgs = [dict(m) for m in conv["messages"]]
        msgs[first]["content"] = "Context:\n" + "\n\n".join(pieces) + "\n\n" + msgs[first]["content"]
        out = {**conv, "messages": msgs}
        if len(prompt_ids(renderer, out, upto)) >= want_tokens:
            break
    return out


def build_prompt_sets(ev: EvalConfig, renderer: ChatRenderer, prepared: PrepareDir, max_prompt_tokens: int,
                      respond: Callable[[list[int]], str] | None = None,
                      named_info: dict | None = None) -> dict[str, list[list[int]]]:
    """{set name: prompt token ids}; a set whose file is missing is skipped with a warning. Prompts longer
    than ``max_prompt_tokens`` are cut from the left (the generation prompt at the end is kept). A named set
    (evaluation/eval_sets.py) is loaded by hub id or from ``eval.set_paths``, its later turns asked after
    ``respond(prompt_ids)`` (the target's own answer); its counts go to ``named_info[name]``."""

    check_set_names(ev.sets, ev.set_paths)
    sets = {}
    for name in ev.sets:
        if name in EVAL_SETS:
            sets[name], info = _named_set(name, ev, renderer, max_prompt_tokens, respond)
            if named_info is not None:
                s = EVAL_SETS.get(name)
                named_info[name] = {**info, "prompts": len(sets[name]), "hub_id": s.hub_id, "measures": s.measures}
            continue
        path = prepared.conversations(SET_SPLITS[name])
        if not path.exists():
            log.warning("eval: no %s, skipping the %r set", path, name)
            continue
        convs = read_conversations(path)
        chosen = convs[:ev.num_prompts]
        if name in PERTURBATIONS:  # the default set's conversations, one layout change each
            chosen = perturbed(name, convs, ev.num_prompts)
        if name == "long":
            chosen = [lengthen(c, convs[i + 1:] + convs[:i], renderer, ev.long_prompt_tokens)
                      for i, c in enumerate(chosen)]
        sets[name] = [prompt_ids(renderer, c, prompt_upto(c))[-max_prompt_tokens:] for c in chosen]
    return sets


def _named_set(name: str, ev: EvalConfig, renderer: ChatRenderer, max_prompt_tokens: int,
               respond: Callable[[list[int]], str] | None) -> tuple[list[list[int]], dict]:
    """The prompts of the public benchmark ``name`` and its counts (evaluation/eval_sets.py render_prompts)."""
    loaded = load_conversations(name, ev.set_paths.get(name), limit=ev.num_prompts)
    limit = min(max_prompt_tokens, ev.max_prompt_tokens or max_prompt_tokens)
    prompts, info = render_prompts(loaded, renderer, limit, ev.prompt_length_policy, ev.num_prompts, respond)
    if not prompts:
        raise ValueError(f"eval set {name!r}: every prompt is longer than {limit} tokens and "
                         f"eval.prompt_length_policy=skip; raise eval.max_prompt_tokens or use truncate")
    log.info("eval set %s: %d prompt(s) from %s (%d truncated, %d skipped as too long, %d placeholder rows)",
             name, len(prompts), info["source"], info["truncated"], info["skipped_too_long"],
             info["placeholder_rows"])
    return prompts, info


def bucket_prompt_sets(ev: EvalConfig, renderer: ChatRenderer, prepared: PrepareDir,
                       max_pos: int) -> dict[int, list[list[int]]]:
    """{bucket: prompt ids} for ``eval.context_buckets`` (evaluation/long_context.py): the conversations of
    ``eval.long_context_source``, else the eval conversations grown with held-out context, cut to each bucket.
    A bucket the target cannot hold (``max_pos`` positions with the answer), or no conversation long enough
    for the largest, is a ValueError naming the fix."""
    room = max_pos - ev.max_new_tokens - ev.draft_tokens - 2
    if max(ev.context_buckets) > room:
        raise ValueError(f"eval.context_buckets={list(ev.context_buckets)}: the target holds {max_pos} positions, so "
                         f"prompts can have at most {room} tokens (with eval.max_new_tokens={ev.max_new_tokens}); "
                         f"lower the largest bucket")
    if ev.long_context_source:
        convs = long_context.read_long_source(ev.long_context_source)
    else:
        base = read_conversations(prepared.conversations(SET_SPLITS["default"]))
        convs = [lengthen(c, base[i + 1:] + base[:i], renderer, max(ev.context_buckets) + 64)
                 for i, c in enumerate(base[:ev.bucket_prompts])]
    prompts = long_context.bucket_prompts(convs, prompt_upto, lambda c, upto: prompt_ids(renderer, c, upto),
                                          ev.context_buckets, ev.bucket_prompts)
    if not prompts[ev.context_buckets[0]]:
        src = ev.long_context_source or "the eval conversations with held-out context"
        raise ValueError(f"eval.context_buckets: no conversation of {src} reaches {max(ev.context_buckets)} prompt "
                         "tokens; lower the largest bucket or set eval.long_context_source to longer conversations")
    return prompts
