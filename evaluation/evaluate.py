"""The ``eval`` stage: measured acceptance of the exported drafter, honest baselines, drift, held-out accuracy.

For every prompt set (``eval.sets``: ``default``, ``perturbed`` = the data stage's perturbed templates,
``long`` = prompts grown with more held-out context, and the named public benchmarks of evaluation/eval_sets.py,
such as ``mt_bench`` or ``speed_bench_throughput_16k``) it runs, on the same prompts:

- plain greedy decoding of the target (the reference output and the baseline time);
- speculative decoding with the drafter (greedy: asserted identical to the reference, token for token;
  and with rejection sampling when ``eval.temperature > 0``);
- prompt lookup (n-gram copy from the context, same k): the drafter-free baseline that loops inflate.

It also reports the distinct-3-gram ratio of the target's outputs, the share of their tokens the draft
vocab holds (the drafter can propose no other), and AL restricted to prompts whose
output is not degenerate (ratio >= ``eval.degenerate_threshold``), the teacher-forced held-out per-step
accuracy up to 2K steps (natural text: loops cannot inflate it), and the attention-drift curves.
Outputs: the report (report.json, report.md) and PNG plots (evaluation/report.py), where the stage says.

With ``eval.in_process=false`` (a real target, whose harness is slow on CPU) only the engine measures the sets
(evaluation/engine_eval.py): the harness, drift and the offline-vs-measured comparison are skipped, the held-out
accuracy is still measured.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from fledge.atomic import read_jsonl, write_json_atomic
from fledge.conf.schema import draft_steps
from fledge.data.prepare.build import load_tokenizer
from fledge.data.prepare.chat import ChatRenderer, eot_ids_from_target, prompt_ids
from fledge.evaluation import long_context
from fledge.evaluation.drift import drift_curves
from fledge.evaluation.engine_eval import run_engine_eval
from fledge.evaluation.eval_sets import EVAL_SETS, check_set_names, load_conversations, render_prompts
from fledge.evaluation.perturbations import PERTURBATIONS, perturbed
from fledge.evaluation.report import write_report
from fledge.evaluation.speculative import (
    LookupProposer,
    TargetRunner,
    first_divergence,
    greedy_decode,
    proposer_for,
    speculative_decode,
)
from fledge.models import alignment
from fledge.models.algorithms import algorithm_of
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.models.drafter import DrafterSpec
from fledge.models.target import FrozenTarget
from fledge.progress import progress
from fledge.run_layout import EvalDir, PrepareDir
from fledge.serving.engine import check_engine
from fledge.serving.export import load_drafter, spec_from_export

log = logging.getLogger(__name__)
# The prepare stage's eval split each built-in set's prompts come from.
SET_SPLITS = {"default": "eval", "perturbed": "eval_perturbed", "long": "eval", **{p: "eval" for p in PERTURBATIONS}}
# A greedy divergence where the target's top-2 logits are closer than this is a numerical tie (the k+1-token
# verify forward and the 1-token decode round differently), not a harness bug. bf16/fp16 logits carry ~3
# significant digits, so their ties are wider.
TIE_GAP = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TIE_GAP = 0.25


# ------------------------------------------------------------------------------------------ prompts
def read_conversations(path: Path) -> list[dict]:
    return read_jsonl(path, "re-run the prepare stage")


def prompt_upto(conv: dict) -> int:
    """messages[:last_user + 1]: the prompt the target answers last."""
    users = [i for i, m in enumerate(conv["messages"]) if m["role"] == "user"]
    if not users:
        raise ValueError(f"eval conversation {conv.get('source')}:{conv.get('index')} has no user turn")
    return users[-1] + 1


def lengthen(conv: dict, others: Sequence[dict], renderer, want_tokens: int) -> dict:
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


def build_prompt_sets(eval_cfg, renderer, prepared: PrepareDir, max_prompt_tokens: int, respond=None,
                      named_info: dict | None = None) -> dict[str, list[list[int]]]:
    """{set name: prompt token ids}; a set whose file is missing is skipped with a warning. Prompts longer
    than ``max_prompt_tokens`` are cut from the left (the generation prompt at the end is kept). A named set
    (evaluation/eval_sets.py) is loaded by hub id or from ``eval.set_paths``, its later turns asked after
    ``respond(prompt_ids)`` (the target's own answer); its counts go to ``named_info[name]``."""

    check_set_names(eval_cfg.sets, eval_cfg.set_paths)
    sets = {}
    for name in eval_cfg.sets:
        if name in EVAL_SETS:
            loaded = load_conversations(name, eval_cfg.set_paths.get(name), limit=eval_cfg.num_prompts)
            limit = min(max_prompt_tokens, eval_cfg.max_prompt_tokens or max_prompt_tokens)
            sets[name], info = render_prompts(loaded, renderer, limit, eval_cfg.prompt_length_policy,
                                              eval_cfg.num_prompts, respond)
            if not sets[name]:
                raise ValueError(f"eval set {name!r}: every prompt is longer than {limit} tokens and "
                                 f"eval.prompt_length_policy=skip; raise eval.max_prompt_tokens or use truncate")
            if named_info is not None:
                s = EVAL_SETS.get(name)
                named_info[name] = {**info, "prompts": len(sets[name]), "hub_id": s.hub_id, "measures": s.measures}
            log.info("eval set %s: %d prompt(s) from %s (%d truncated, %d skipped as too long, %d placeholder rows)",
                     name, len(sets[name]), info["source"], info["truncated"], info["skipped_too_long"],
                     info["placeholder_rows"])
            continue
        path = prepared.conversations(SET_SPLITS[name])
        if not path.exists():
            log.warning("eval: no %s, skipping the %r set", path, name)
            continue
        convs = read_conversations(path)
        chosen = convs[:eval_cfg.num_prompts]
        if name in PERTURBATIONS:  # the default set's conversations, one layout change each
            chosen = perturbed(name, convs, eval_cfg.num_prompts)
        if name == "long":
            chosen = [lengthen(c, convs[i + 1:] + convs[:i], renderer, eval_cfg.long_prompt_tokens)
                      for i, c in enumerate(chosen)]
        sets[name] = [prompt_ids(renderer, c, prompt_upto(c))[-max_prompt_tokens:] for c in chosen]
    return sets


# ------------------------------------------------------------------------------------------ metrics
def distinct_ngram_ratio(tokens: Sequence[int], n: int = 3) -> float:
    """Distinct n-grams / all n-grams of ``tokens`` (1.0 when too short to judge): low means loops."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def draft_vocab_coverage(outputs: Sequence[Sequence[int]], t2d: torch.Tensor) -> float:
    """The share of the tokens in ``outputs`` (target ids) that lie in the draft vocab (``t2d``, bool
    ``[V]``): where the target writes any other token, no draft can be accepted (NaN: no tokens)."""
    written = torch.tensor([t for out in outputs for t in out], dtype=torch.long)
    return float(t2d.cpu()[written].float().mean()) if written.numel() else float("nan")


def acceptance_stats(results, k: int) -> dict:
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


def evaluate_set(name: str, prompts: list[list[int]], target_model, drafter, eval_cfg, eos_ids, seed: int) -> dict:
    """All the harness numbers of one prompt set (see the module docstring)."""
    k, max_new = eval_cfg.draft_tokens, eval_cfg.max_new_tokens
    runner = TargetRunner(target_model, drafter.spec.aux_layer_ids)
    plain = TargetRunner(target_model)
    drafter_prop, lookup = proposer_for(drafter), LookupProposer(eval_cfg.lookup_max_ngram)
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
        if eval_cfg.temperature > 0:
            sampled.append(speculative_decode(runner, drafter_prop, prompt, k, max_new, eos_ids,
                                              eval_cfg.temperature, gen))
    d3 = [distinct_ngram_ratio(r) for r in refs]
    ok = [i for i, v in enumerate(d3) if v >= eval_cfg.degenerate_threshold]
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


def evaluate_buckets(cfg, renderer, prepared: PrepareDir, target_model, drafter, eos, max_pos: int) -> list[dict]:
    """The set harness and the drift probe on each of ``eval.context_buckets`` (evaluation/long_context.py)."""

    ev, K = cfg.eval, draft_steps(cfg.drafter)
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
    out = []
    depth = ev.drift_depth or max(ev.draft_tokens, 2 * K)
    for b, ps in prompts.items():
        res = evaluate_set(f"context {b}", ps, target_model, drafter, ev, eos, cfg.run.seed)
        drift = drift_curves(drafter, TargetRunner(target_model, drafter.spec.aux_layer_ids), ps, depth,
                             desc=f"drift context {b}")
        out.append(long_context.summarize(b, res, drift))
    return out


# Held-out rows are one length per run (below): flex attention is compiled with static shapes, one compile
# per key length (J + 1) T, and a row length per sample recompiled it for every sample (silently falling back
# to the eager kernel, which materialises the scores, past dynamo's limit).
HELDOUT_MIN_ROW = 128  # flex's sparse block size


def heldout_row_length(longest: int) -> int:
    """The row length of a held-out run: the smallest power of two >= ``longest`` and >= HELDOUT_MIN_ROW, so
    that runs of similar data share it too (a handful of lengths in all)."""
    return max(HELDOUT_MIN_ROW, 1 << max(0, longest - 1).bit_length())


def pack_heldout(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Sample indices per row, in order, each row holding samples whose lengths add up to <= ``row_len``."""
    rows: list[list[int]] = []
    used = row_len
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(f"held-out sample {i} has {n} tokens; row length {row_len}")
        if used + n > row_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


@torch.inference_mode()
def heldout_accuracy(drafter, frozen, samples: Sequence[tuple[list[int], list[int]]], steps: int,
                     chunk_tokens: int = 0) -> dict:
    if algorithm_of(drafter.spec).block:
        return block_heldout_accuracy(drafter, frozen, samples, steps, chunk_tokens)
    return chain_heldout_accuracy(drafter, frozen, samples, steps, chunk_tokens)


BLOCK_ANCHORS = 128  # anchors per held-out block forward


@torch.inference_mode()
def block_heldout_accuracy(drafter, frozen, samples: Sequence[tuple[list[int], list[int]]], steps: int,
                           chunk_tokens: int = 0) -> dict:
    """``heldout_accuracy`` of a block drafter (models/dflash.py): a block of ``steps`` masks after every anchor a
    whose next token the target generates, each slot k scored where x_{a+k} is in the loss mask, against the target's
    argmax at a + k - 1; ``full_acc[j]`` over anchors whose slots 1..j+1 are all scored, right when all are."""
    from fledge.models.dflash import block_mask

    hit, full, rows = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    full_rows = torch.zeros(steps)
    dev = drafter.lm_head.weight.device
    B = steps + 1
    for ids, mask in progress(samples, desc="held-out accuracy", leave=False):
        x = torch.tensor([ids], device=frozen.device)
        a_all, _, am = frozen.capture(x, chunk_tokens=chunk_tokens)
        T = len(ids)
        m = torch.tensor(mask, dtype=torch.bool, device=dev)
        am, x = am[0].to(dev), x[0].to(dev)
        kv = drafter.context_kv(drafter.context(a_all.to(dev, drafter.lm_head.weight.dtype)),
                                torch.arange(T, device=dev)[None])
        doc = torch.zeros(T, dtype=torch.int32, device=dev)
        anchors = (m[1:]).nonzero().flatten()
        for s in range(0, len(anchors), BLOCK_ANCHORS):
            a = anchors[s:s + BLOCK_ANCHORS]
            bids = torch.full((len(a), B), drafter.spec.mask_token_id, dtype=torch.long, device=dev)
            bids[:, 0] = x[a]
            pos = a[:, None] + torch.arange(B, device=dev)
            y = drafter.blocks(bids.reshape(1, -1), pos.reshape(1, -1), kv, block_mask(a, doc, B)[None, None])
            pred = drafter.lm_head(y.view(len(a), B, -1)[:, 1:]).argmax(-1)  # [N, steps]
            p = a[:, None] + torch.arange(1, B, device=dev)
            scored = (p < T) & m[p.clamp(max=T - 1)]
            ok = (pred == am[p.clamp(max=T - 1) - 1]) & scored
            hit += ok.sum(0).float().cpu()
            rows += scored.sum(0).float().cpu()
            full += ok.cumprod(1).sum(0).float().cpu()
            full_rows += scored.cumprod(1).sum(0).float().cpu()
    acc = (hit / rows.clamp_min(1)).tolist()
    full_acc = (full / full_rows.clamp_min(1)).tolist()
    return {"steps": steps, "acc": acc, "full_acc": full_acc, "rows": rows.tolist()}


@torch.inference_mode()
def chain_heldout_accuracy(drafter, frozen, samples: Sequence[tuple[list[int], list[int]]], steps: int,
                           chunk_tokens: int = 0) -> dict:
    """Teacher-forced per-step accuracy on held-out conversations (one document each), unrolled ``steps``
    TTT steps, beyond the trained K too. Step j's inputs and scored rows are training's
    (models/alignment.py): a row whose teacher argmax lies outside the draft vocab is a miss, as it is when
    drafting. ``full_acc[j]`` counts, among step j's scored rows, those whose steps 0..j were all right:
    this is the offline side of the offline-vs-measured comparison. ``rows[j]``: step j's scored rows.

    The target reads each conversation alone; the drafter reads them packed as documents into rows of one
    length (``heldout_row_length``; padding is document -1 and never counts), which the TTT mask keeps
    apart, so the numbers are those of one conversation per row."""
    hit, full, rows = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    dev, dtype = drafter.lm_head.weight.device, drafter.lm_head.weight.dtype
    if not samples:
        return {"steps": steps, "acc": [0.0] * steps, "full_acc": [0.0] * steps, "rows": rows.tolist()}
    R = heldout_row_length(max(len(ids) for ids, _ in samples))
    for members in progress(pack_heldout([len(ids) for ids, _ in samples], R), desc="held-out accuracy", leave=False):
        x = torch.zeros(1, R, dtype=torch.long, device=dev)
        argmax, aux = torch.zeros_like(x), None
        m = torch.zeros(1, R, dtype=torch.bool, device=dev)
        doc = torch.full((1, R), -1, dtype=torch.int32, device=dev)
        pos = torch.zeros(1, R, dtype=torch.long, device=dev)
        at = 0
        for d, i in enumerate(members):
            ids, mask = samples[i]
            n = len(ids)
            a, _, am = frozen.capture(torch.tensor([ids], device=frozen.device), chunk_tokens=chunk_tokens)
            if aux is None:
                aux = torch.zeros(1, R, a.shape[-1], dtype=dtype, device=dev)
            sl = slice(at, at + n)
            x[0, sl], argmax[0, sl], aux[0, sl] = torch.tensor(ids, device=dev), am[0].to(dev), a[0].to(dev, dtype)
            m[0, sl], doc[0, sl] = torch.tensor(mask, dtype=torch.bool, device=dev), d
            pos[0, sl] = torch.arange(n, device=dev)
            at += n
        all_ok = torch.ones(1, R, dtype=torch.bool, device=dev)
        for j, y in enumerate(alignment.unroll(drafter, aux, x, pos, doc, steps)):
            step = alignment.step_rows(m, doc, argmax, drafter.t2d, j)
            ok = drafter.draft_to_target(drafter.lm_head(y).argmax(-1)) == step.teacher_argmax
            all_ok &= ok
            hit[j] += float((ok & step.scored).sum())
            full[j] += float((all_ok & step.scored).sum())
            rows[j] += float(step.scored.sum())
    acc = (hit / rows.clamp_min(1)).tolist()
    full_acc = (full / rows.clamp_min(1)).tolist()
    return {"steps": steps, "acc": acc, "full_acc": full_acc, "rows": rows.tolist()}


# ------------------------------------------------------------------------------------------ the stage
def load_eval_models(cfg, drafter_dir: Path, device: torch.device, served: DrafterSpec):
    """(FrozenTarget, drafter) as eval runs them, the drafter built as ``served`` (the export's spec as an
    engine reads it: ``spec_from_export(..., serving=True)``). The drafter is fp32 everywhere. On CPU the
    target is fp32 too, whatever the CPU: greedy tie gaps (TIE_GAP) and the golden AL then do not depend on
    whether the CPU has native bf16 (where it does not, FrozenTarget.load has already made it fp32). On CUDA
    the target keeps ``target.dtype``."""

    frozen = FrozenTarget.load(cfg.target, device, served.aux_layer_ids)
    if device.type == "cpu":
        frozen.model.float()
    head = (frozen.model.get_output_embeddings().weight.detach().float().cpu()
            if algorithm_of(served).target_head else None)
    drafter = load_drafter(drafter_dir, embed_weight=frozen.input_embeddings().float().cpu(), head_weight=head,
                           dtype=torch.float32, device=device, spec=served).eval()
    return frozen, drafter


def evaluate_run(cfg, prepared: PrepareDir, out: EvalDir, drafter_dir: Path, device: torch.device,
                 metrics_path: Path | None = None, train_al_estimate: float | None = None) -> dict:
    """Everything the eval stage measures, for an exported drafter in ``drafter_dir``, on the prompts of the
    prepare stage's outputs ``prepared``; the report goes to ``out``. ``metrics_path``: the train stage's log
    (the report plots it); ``train_al_estimate``: its best AL estimate (the report and the engine's collapse
    check compare the measured AL with it)."""

    ev, K = cfg.eval, draft_steps(cfg.drafter)
    engine_python = check_engine(ev.engine, device.type, ev.engine_python)  # before any work: fail fast
    renderer = ChatRenderer(load_tokenizer(cfg.target, cfg.data.chat_template),
                            extra_eot_ids=eot_ids_from_target(cfg.target.name_or_path, cfg.target.revision))
    eos = sorted(renderer.eot_ids)
    # Measure what an engine serves: the drafter config.json and the weights describe (its aux ids, layer
    # settings, flags), not the training record: a config.json that disagrees with training shows in the AL.
    served = spec_from_export(drafter_dir, serving=True)
    frozen, drafter = load_eval_models(cfg, drafter_dir, device, served)
    target_model = frozen.model
    max_pos = int(getattr(target_model.config, "max_position_embeddings", 1 << 30))
    plain = TargetRunner(target_model)

    def respond(prompt: list[int]) -> str:  # a multi-turn set's earlier answers: the target's own, greedy
        out, _ = greedy_decode(plain, prompt, ev.max_new_tokens, eos)
        return renderer.tok.decode([t for t in out if t not in renderer.eot_ids], skip_special_tokens=True)

    named: dict = {}
    # Engine alone (eval.in_process=false): only the sets it serves are built (a named set's earlier turns cost
    # the target's greedy answers).
    built = ev if ev.in_process or not ev.engine_sets else dataclasses.replace(ev, sets=list(ev.engine_sets))
    sets = build_prompt_sets(built, renderer, prepared, max_pos - ev.max_new_tokens - ev.draft_tokens - 2, respond,
                             named)
    if not sets:
        raise ValueError(f"eval: no prompt set could be built from {prepared.root} (eval.sets={ev.sets}); run prepare")
    report: dict = {"drafter": str(drafter_dir), "k": ev.draft_tokens, "ttt_steps": K,
                    "max_new_tokens": ev.max_new_tokens, "temperature": ev.temperature,
                    "degenerate_threshold": ev.degenerate_threshold, "in_process": ev.in_process,
                    "flags": {f: bool(getattr(drafter.spec, f)) for f in ("fc_norm", "norm_output")}, "sets": {}}
    if named:
        report["named_sets"] = named
    if ev.in_process:  # the harness on every set; eval.in_process=false leaves the sets to the engine alone
        for name, prompts in sets.items():
            report["sets"][name] = evaluate_set(name, prompts, target_model, drafter, ev, eos, cfg.run.seed)
            write_json_atomic(out.partial_json, report)
        depth = ev.drift_depth or max(ev.draft_tokens, 2 * K)
        if drafter.spec.algorithm == "eagle":  # the drift probe follows a chain's fed-back state (none in a block)
            report["drift"] = {name: drift_curves(drafter, TargetRunner(target_model, drafter.spec.aux_layer_ids),
                                                  prompts, depth, desc=f"drift {name}")
                               for name, prompts in sets.items()}
    default = prepared.conversations(SET_SPLITS["default"])
    if default.exists():
        samples = [renderer.encode(c, f"{default}:{i + 1}")
                   for i, c in enumerate(read_conversations(default)[:ev.num_prompts])]
        report["heldout"] = heldout_accuracy(drafter, frozen, samples, ev.heldout_steps or 2 * K,
                                             cfg.capture.chunk_tokens)
        if report["sets"]:
            report["offline_vs_measured"] = offline_vs_measured(report)
    if ev.context_buckets:  # AL and drift vs context length (evaluation/long_context.py)
        report["context_buckets"] = evaluate_buckets(cfg, renderer, prepared, target_model, drafter, eos, max_pos)
    report["train_al_estimate"] = train_al_estimate
    if engine_python is not None:  # eval.engine=vllm: the same prompts served by the engine (evaluation/engine_eval.py)

        engine_sets = {n: p for n, p in sets.items() if not ev.engine_sets or n in ev.engine_sets}
        report["engine"] = run_engine_eval(cfg, engine_sets, report, drafter_dir, out.engine_work, eos, max_pos,
                                           device.type, engine_python)
    write_report(report, out, metrics_path)
    out.partial_json.unlink(missing_ok=True)
    if report.get("engine", {}).get("failures"):  # after the report is written, so the numbers can be read
        raise ValueError("\n".join(report["engine"]["failures"]) + f"\n(report: {out.report_md})")
    return stage_summary(report, out)


def offline_vs_measured(report: dict) -> dict:
    """The held-out estimate per position beside the acceptance measured in process on the default set (else the
    first set)."""
    first = "default" if "default" in report["sets"] else next(iter(report["sets"]))
    measured = report["sets"][first]["drafter"]["accept_at"]
    offline = StepAccuracy(report["heldout"]["acc"][:len(measured)], report["heldout"]["full_acc"][:len(measured)])
    return {"set": first, "offline_full_acc": offline.full_acc, "measured_accept_at": measured,
            "gap": [m - o for m, o in zip(measured, offline.full_acc)], "offline_al": al_estimate(offline),
            "measured_al": report["sets"][first]["drafter"]["al"]}


def stage_summary(report: dict, out: EvalDir) -> dict:
    """The stage's outputs (its manifest; the model card's table): ``al_<set>`` / ``al_lookup_<set>`` are the
    in-process ALs (the tiny recipes' goldens), absent when eval.in_process=false rather than standing in for the
    engine's, which are ``al_engine_<set>`` / ``al_lookup_engine_<set>`` (vLLM's ngram, per draft)."""
    engine = report.get("engine", {}).get("sets", {})
    return {**{f"al_engine_{n}": s["drafter"]["al"] for n, s in engine.items()},
            **{f"al_lookup_engine_{n}": s["lookup"]["al"] for n, s in engine.items()},
            "report": str(out.report_md), "json": str(out.report_json),
            **{f"al_{n}": s["drafter"]["al"] for n, s in report["sets"].items()},
            **{f"al_lookup_{n}": s["lookup"]["al"] for n, s in report["sets"].items()}}
