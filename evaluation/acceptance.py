"""The in-process harness on one prompt set: acceptance of the drafter and of prompt lookup, and the output's health.

On the same prompts it runs plain greedy decoding of the target (the reference output and the baseline time),
speculative decoding with the drafter (greedy: asserted identical to the reference, token for token; and with
rejection sampling when ``eval.temperature > 0``) and prompt lookup (n-gram copy from the context, same k: the
drafter-free baseline that loops inflate), all through evaluation/speculative.py. Beside the acceptance figures
it reports the distinct-3-gram ratio of the target's outputs, the share of their tokens the draft vocab holds
(the drafter can propose no other), and AL restricted to prompts whose output is not degenerate (ratio >=
``eval.degenerate_threshold``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fledge.conf.schema import EvalConfig
from fledge.evaluation.speculative import (
    DecodeResult,
    LookupProposer,
    TargetRunner,
    first_divergence,
    greedy_decode,
    proposer_for,
    speculative_decode,
)
from fledge.progress import progress

# A greedy divergence where the target's top-2 logits are closer than this is a numerical tie (the k+1-token
# verify forward and the 1-token decode round differently), not a harness bug. bf16/fp16 logits carry ~3
# significant digits, so their ties are wider.
TIE_GAP = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TIE_GAP = 0.25


def distinct_ngram_ratio(tokens: Sequence[int], n: int = 3) -> float:
    """Distinct n-grams / all n-grams of ``tokens`` (1.0 when too short to judge): low means loops."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def draft_vocab_coverage(outputs: Sequence[Sequence[int]], t2d: torch.Tensor) -> float:
    """The share of the tokens in ``outputs`` (target ids) that lie in the draft vocab (``t2d``, bool
    ``[V]``): where the target writes any other token, no draft can be accepted (NaN: no tokens)."""
    written = torch.tensor([t for out in outputs for t in out], dtype=torch.long)
    return float(t2d.cpu()[written].float().mean()) if written.numel() else float("nan")


def acceptance_stats(results: Sequence[DecodeResult], k: int) -> dict:
    """Mean AL (bonus included, max k + 1) and per-position acceptance over the rounds not cut by the
    token budget. ``accept_at[i]`` = P(accepted >= i+1) over those rounds (a prompt-lookup miss drafts
    nothing and counts as a rejection), so AL = 1 + sum(accept_at) up to end-of-turn cuts;
    ``accept_cond[i]`` = the same given draft i was accepted. ``al_uncut`` = 1 + sum(accept_at) is AL as an
    engine's counters give it (vLLM: 1 + accepted / drafts), where drafts accepted past the end-of-turn token of
    a round still count: above ``al`` by about one cut round per answer on a target whose answers end.
    ``al_per_draft`` = 1 + accepted / ``drafts`` over the rounds that proposed anything, which is how vLLM counts
    its ngram method (a round without a match is no draft there, where ``al`` counts it as AL 1); the drafter
    always proposes, so for it this is ``al_uncut``."""
    rounds = [r for res in results for r in res.rounds if not r.budget_limited]
    n = len(rounds)
    drafted = [r for r in rounds if r.drafted]
    reach = [sum(r.accepted >= i for r in rounds) for i in range(k + 1)]
    out = {"rounds": n, "al": sum(r.emitted for r in rounds) / n if n else float("nan"),
           "accept_at": [reach[i] / n if n else float("nan") for i in range(1, k + 1)],
           "accept_cond": [reach[i] / reach[i - 1] if reach[i - 1] else float("nan") for i in range(1, k + 1)],
           "al_uncut": 1 + sum(reach[1:]) / n if n else float("nan"),
           "drafts": len(drafted),
           "al_per_draft": 1 + sum(r.accepted for r in drafted) / len(drafted) if drafted else float("nan"),
           "draft_s": sum(r.draft_s for r in results), "verify_s": sum(r.verify_s for r in results),
           "tokens": sum(len(r.tokens) for r in results)}
    return out


def _greedy_tie(runner: TargetRunner, prompt: list[int], ref: list[int], at: int) -> bool:
    """Whether the target's top-2 logits at generated position ``at`` are within the tie gap."""
    runner.reset()
    logits, _ = runner.prefill(list(prompt) + ref[:at])
    top = logits[-1].topk(2).values
    dtype = next(runner.model.parameters()).dtype
    return float(top[0] - top[1]) < TIE_GAP.get(dtype, HALF_TIE_GAP)


def evaluate_set(name: str, prompts: list[list[int]], target_model: nn.Module, drafter: nn.Module, ev: EvalConfig,
                 eos_ids: Sequence[int], seed: int) -> dict:
    """All the harness numbers of one prompt set (see the module docstring); ``seed`` seeds the sampled pass."""
    k, max_new = ev.draft_tokens, ev.max_new_tokens
    runner = TargetRunner(target_model, drafter.spec.aux_layer_ids)
    plain = TargetRunner(target_model)
    drafter_prop, lookup = proposer_for(drafter), LookupProposer(ev.lookup_max_ngram)
    refs, plain_s, spec, look, ties, sampled = [], 0.0, [], [], 0, []
    gen = torch.Generator().manual_seed(seed)
    for prompt in progress(prompts, desc=f"eval {name}", leave=False):
        ref, sec = greedy_decode(plain, prompt, max_new, eos_ids)
        refs.append(ref)
        plain_s += sec
        res = speculative_decode(runner, drafter_prop, prompt, k, max_new, eos_ids)
        at = first_divergence(res.tokens, ref)
        if at is not None:
            if not _greedy_tie(plain, prompt, ref, at):
                raise AssertionError(
                    f"eval {name}: speculative greedy output differs from plain greedy decoding at token {at} "
                    f"({res.tokens[at:at + 3]} vs {ref[at:at + 3]}) without a numerical tie: a harness bug")
            ties += 1
        spec.append(res)
        look.append(speculative_decode(plain, lookup, prompt, k, max_new, eos_ids))
        if ev.temperature > 0:
            sampled.append(speculative_decode(runner, drafter_prop, prompt, k, max_new, eos_ids, ev.temperature, gen))
    d3 = [distinct_ngram_ratio(r) for r in refs]
    ok = [i for i, v in enumerate(d3) if v >= ev.degenerate_threshold]
    out = {"prompts": len(prompts), "prompt_tokens_mean": sum(map(len, prompts)) / max(1, len(prompts)),
           "draft_vocab_coverage": draft_vocab_coverage(refs, drafter.t2d),
           "drafter": acceptance_stats(spec, k), "lookup": acceptance_stats(look, k),
           "distinct3_mean": sum(d3) / max(1, len(d3)), "distinct3": d3, "non_degenerate_prompts": len(ok),
           "drafter_non_degenerate": acceptance_stats([spec[i] for i in ok], k),
           "lookup_non_degenerate": acceptance_stats([look[i] for i in ok], k),
           "plain_s": plain_s, "greedy_ties": ties}
    for key in ("drafter", "lookup"):
        out[key]["speedup"] = plain_s / max(1e-9, out[key]["draft_s"] + out[key]["verify_s"])
    out["al_minus_lookup"] = out["drafter"]["al"] - out["lookup"]["al"]
    out["al_minus_lookup_non_degenerate"] = (out["drafter_non_degenerate"]["al"]
                                             - out["lookup_non_degenerate"]["al"])
    if sampled:
        out["drafter_sampled"] = acceptance_stats(sampled, k)
    return out
