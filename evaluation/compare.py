"""EAGLE-3.1 vs EAGLE-3: one comparison report from two runs' eval reports.

Train both drafters on the same data and steps (same recipe, only the drafter group differs), then compare:

    torchrun --nproc_per_node=2 train/main.py recipe=tiny drafter=eagle31 run.name=tiny_eagle31
    torchrun --nproc_per_node=2 train/main.py recipe=tiny drafter=eagle3  run.name=tiny_eagle3
    fledge compare outputs/tiny_eagle31 outputs/tiny_eagle3 --out outputs/compare_tiny

(The two runs each prepare and capture their own copy; to share them, copy ``prepare/`` and ``capture/``
from the first run directory into the second before its command: matching manifests are skipped.)

Reads ``<run>/eval/report.json`` of each (evaluation/evaluate.py) and writes to ``--out``: compare.md (also
printed, ready for the README / recipes/tiny), compare.json, and plots: acceptance per position, drift
curves and held-out accuracy per step (3.1 solid, 3 dashed), and the offline-estimate vs measured gap per
position. Figures: AL(3.1)/AL(3) and drafter-minus-lookup AL per set (default / perturbed / long), held-out
accuracy per step up to 2K, offline AL estimate vs measured AL; with ``eval.context_buckets`` on both runs,
AL(3.1)/AL(3) and the drift figures per context length, and ``compare_al_vs_length.png``.

Over seeds, as the paper measures (pipeline/seeds.py trains both drafters per seed from one capture):

    fledge compare --train outputs/compare_tiny --seeds 0 1 2 --nproc 2 -- recipe=tiny eval.engine=vllm
    fledge compare --eagle31 outputs/c/eagle31_s0 outputs/c/eagle31_s1 --eagle3 outputs/c/eagle3_s0 ... --out DIR

writes the same files, headed by the table over seeds: per set and AL kind (greedy and sampled at
eval.temperature, in process and, with eval.engine=vllm, in vLLM) each drafter's mean ± std, AL(3.1)/AL(3) of
the means beside the paper's ratio, prompt lookup and distinct-3; perturbed over default AL per drafter (a
perturbation that leaves EAGLE-3's AL where it was does not stress a drafter); AL per context length. The
single-run tables and plots below it are the first seed's pair.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fledge.atomic import write_bytes_atomic, write_json_atomic
from fledge.evaluation.eval_sets import EVAL_SETS
from fledge.evaluation.long_context import drift_at
from fledge.evaluation.perturbations import PERTURBATIONS
from fledge.evaluation.report import plot_context
from fledge.evaluation.seeds import (
    cell,
    load_run,
    require_engine_checks_passed,
    require_in_process,
    set_figures,
    spread,
    warnings,
)
from fledge.run_layout import RunLayout

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LABELS = ("EAGLE-3.1", "EAGLE-3")
# The EAGLE-3.1 paper's AL(3.1)/AL(3), per eval set of ours that measures the same thing.
PAPER = {"default": "1.10x (standard benchmarks)", "perturbed": "up to 2x (template perturbation)",
         "long": "1.18x (long context)", **{p: "up to 2x (template perturbation)" for p in PERTURBATIONS}}
PERTURBED_SETS = ("perturbed", *PERTURBATIONS)  # each set over ``default`` is one perturbation's effect
STANDARD = "1.10x (standard benchmarks)"  # the paper's mean over seven standard sets: ours are default + named ones
AL_KINDS = (("al", "greedy"), ("al_sampled", "sampled"), ("al_engine", "vLLM greedy"),
            ("al_engine_sampled", "vLLM sampled"))


def load_report(run_dir: Path, want_31: bool) -> dict:
    path = RunLayout(run_dir).eval.report_json
    if not path.exists():
        raise SystemExit(f"{path} not found: run the pipeline through the eval stage for {run_dir}")
    report = json.loads(path.read_text())
    require_in_process(report, path)
    require_engine_checks_passed(report, path)
    flags = report["flags"]
    if (flags["fc_norm"] and flags["norm_output"]) != want_31 or (not want_31 and any(flags.values())):
        print(f"warning: {path} has flags {flags}, expected {'EAGLE-3.1' if want_31 else 'EAGLE-3'}", file=sys.stderr)
    return report


def _f(x: float | None, d: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing (a report writes an AL over no rounds as null) or b is 0."""
    return a / b if a is not None and b else None


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def compare(r31: dict, r3: dict) -> dict:
    """The comparison figures (JSON-safe)."""
    out: dict = {"k": r31["k"], "ttt_steps": r31["ttt_steps"], "temperature": r31.get("temperature", 0.0), "sets": {}}
    if r31["k"] != r3["k"] or r31["ttt_steps"] != r3["ttt_steps"]:
        out["warning"] = f"k / K differ: 3.1 k={r31['k']} K={r31['ttt_steps']}, 3 k={r3['k']} K={r3['ttt_steps']}"
    for name in [n for n in r31["sets"] if n in r3["sets"]]:
        a, b = r31["sets"][name], r3["sets"][name]
        out["sets"][name] = {
            "al_31": a["drafter"]["al"], "al_3": b["drafter"]["al"],
            "al_ratio": _ratio(a["drafter"]["al"], b["drafter"]["al"]),
            "lookup_al": a["lookup"]["al"],
            "minus_lookup_31": a["al_minus_lookup"], "minus_lookup_3": b["al_minus_lookup"],
            "al_ratio_non_degenerate": _ratio(a["drafter_non_degenerate"]["al"], b["drafter_non_degenerate"]["al"]),
            "minus_lookup_non_degenerate_31": a["al_minus_lookup_non_degenerate"],
            "minus_lookup_non_degenerate_3": b["al_minus_lookup_non_degenerate"],
            "accept_at_31": a["drafter"]["accept_at"], "accept_at_3": b["drafter"]["accept_at"],
            "distinct3": a["distinct3_mean"],
        }
        if "drafter_sampled" in a and "drafter_sampled" in b:  # eval.temperature > 0 on both runs
            sa, sb = a["drafter_sampled"]["al"], b["drafter_sampled"]["al"]
            out["sets"][name].update(al_sampled_31=sa, al_sampled_3=sb, al_sampled_ratio=_ratio(sa, sb))
    for key in ("heldout", "offline_vs_measured", "drift"):
        out[key] = {LABELS[0]: r31.get(key), LABELS[1]: r3.get(key)}
    b31, b3 = r31.get("context_buckets") or [], r3.get("context_buckets") or []
    if b31 and b3:  # eval.context_buckets on both runs: AL vs context length
        by3 = {s["bucket"]: s for s in b3}
        out["context"] = [_context_row(a, by3[a["bucket"]]) for a in b31 if a["bucket"] in by3]
    return out


def _context_row(a: dict, b: dict) -> dict:

    row = {"bucket": a["bucket"], "prompts": a["prompts"], "prompt_tokens_mean": a["prompt_tokens_mean"],
           "al_31": a["al"], "al_3": b["al"], "al_ratio": _ratio(a["al"], b["al"]), "lookup_al": a["lookup_al"]}
    if a.get("al_sampled") is not None and b.get("al_sampled") is not None:  # eval.temperature > 0
        row.update(al_sampled_31=a["al_sampled"], al_sampled_3=b["al_sampled"],
                   al_sampled_ratio=_ratio(a["al_sampled"], b["al_sampled"]))
    for lab, s in (("31", a), ("3", b)):
        for key in ("sink", "context", "drafted", "state_rms"):
            row[f"{key}_{lab}"] = drift_at(s, key)
    return row


def markdown(c: dict) -> str:
    k = c["k"]
    lines = [f"## EAGLE-3.1 vs EAGLE-3 (chain k={k}, trained K={c['ttt_steps']}, greedy)", ""]
    if "warning" in c:
        lines += [f"**Warning:** {c['warning']}", ""]
    lines += ["| set | AL 3.1 | AL 3 | AL(3.1)/AL(3) | lookup AL | 3.1 - lookup | 3 - lookup | ratio (non-deg.) | "
              "3.1 - lookup (non-deg.) | 3 - lookup (non-deg.) |", "|---" * 10 + "|"]
    for name, s in c["sets"].items():
        lines.append(f"| {name} | {_f(s['al_31'])} | {_f(s['al_3'])} | {_f(s['al_ratio'])} | {_f(s['lookup_al'])} | "
                     f"{_f(s['minus_lookup_31'])} | {_f(s['minus_lookup_3'])} | {_f(s['al_ratio_non_degenerate'])} | "
                     f"{_f(s['minus_lookup_non_degenerate_31'])} | {_f(s['minus_lookup_non_degenerate_3'])} |")
    sampled = [(n, s) for n, s in c["sets"].items() if "al_sampled_31" in s]
    if sampled:
        lines += ["", f"Sampled (rejection sampling at temperature {c['temperature']}, the same prompts):", "",
                  "| set | AL 3.1 | AL 3 | AL(3.1)/AL(3) |", "|---" * 4 + "|"]
        lines += [f"| {n} | {_f(s['al_sampled_31'])} | {_f(s['al_sampled_3'])} | {_f(s['al_sampled_ratio'])} |"
                  for n, s in sampled]
    h31, h3 = c["heldout"][LABELS[0]], c["heldout"][LABELS[1]]
    if h31 and h3:
        n = min(h31["steps"], h3["steps"])
        lines += ["", "Held-out teacher-forced accuracy per step (steps >= K are beyond training):", "",
                  "| | " + " | ".join(str(j) for j in range(n)) + " |", "|---" * (n + 1) + "|"]
        for lab, h in ((LABELS[0], h31), (LABELS[1], h3)):
            lines.append(f"| {lab} acc | " + " | ".join(_f(v) for v in h["acc"][:n]) + " |")
        for lab, h in ((LABELS[0], h31), (LABELS[1], h3)):
            lines.append(f"| {lab} full acc | " + " | ".join(_f(v) for v in h["full_acc"][:n]) + " |")
    o31, o3 = c["offline_vs_measured"][LABELS[0]], c["offline_vs_measured"][LABELS[1]]
    if o31 and o3:
        lines += ["", "Offline estimate (held-out full_acc) vs measured acceptance per position (gap = measured - "
                  "offline):", "", "| position | " + " | ".join(f"{lab} offline | {lab} measured | {lab} gap"
                                                               for lab in LABELS) + " |", "|---" * 7 + "|"]
        for i in range(min(len(o31["gap"]), len(o3["gap"]))):
            cells = [f"{_f(o['offline_full_acc'][i])} | {_f(o['measured_accept_at'][i])} | {_f(o['gap'][i])}"
                     for o in (o31, o3)]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
        lines.append(f"| AL | {_f(o31['offline_al'])} | {_f(o31['measured_al'])} | "
                     f"{_f(_minus(o31['measured_al'], o31['offline_al']))} | {_f(o3['offline_al'])} | "
                     f"{_f(o3['measured_al'])} | {_f(_minus(o3['measured_al'], o3['offline_al']))} |")
    d31, d3 = c["drift"][LABELS[0]], c["drift"][LABELS[1]]
    if d31 and d3 and "default" in d31 and "default" in d3:
        a, b = d31["default"], d3["default"]
        lines += ["", "Attention drift, default set (sink / own-draft attention mass, fed-back RMS) per depth:", "",
                  "| depth | 3.1 sink | 3 sink | 3.1 drafted | 3 drafted | 3.1 RMS | 3 RMS |", "|---" * 7 + "|"]
        for i in range(min(len(a["depth"]), len(b["depth"]))):
            lines.append(f"| {a['depth'][i]} | {_f(a['sink'][i], 3)} | {_f(b['sink'][i], 3)} | "
                         f"{_f(a['drafted'][i], 3)} | {_f(b['drafted'][i], 3)} | {_f(a['state_rms'][i], 3)} | "
                         f"{_f(b['state_rms'][i], 3)} |")
    if c.get("context"):
        lines += ["", "Acceptance vs context length (the same conversations cut to each length; drift figures "
                  "averaged over the fed-back depths):", "",
                  "| context tokens | prompts | AL 3.1 | AL 3 | AL(3.1)/AL(3) | lookup AL | 3.1 drafted attn | "
                  "3 drafted attn | 3.1 sink | 3 sink | 3.1 RMS | 3 RMS |", "|---" * 12 + "|"]
        for r in c["context"]:
            lines.append(f"| {r['bucket']} | {r['prompts']} | {_f(r['al_31'])} | {_f(r['al_3'])} | "
                         f"{_f(r['al_ratio'])} | "
                         f"{_f(r['lookup_al'])} | {_f(r['drafted_31'], 3)} | {_f(r['drafted_3'], 3)} | "
                         f"{_f(r['sink_31'], 3)} | {_f(r['sink_3'], 3)} | {_f(r['state_rms_31'], 3)} | "
                         f"{_f(r['state_rms_3'], 3)} |")
        rows = [r for r in c["context"] if "al_sampled_31" in r]
        if rows:
            lines += ["", f"Acceptance vs context length, sampled (temperature {c['temperature']}):", "",
                      "| context tokens | AL 3.1 | AL 3 | AL(3.1)/AL(3) |", "|---" * 4 + "|"]
            lines += [f"| {r['bucket']} | {_f(r['al_sampled_31'])} | {_f(r['al_sampled_3'])} | "
                      f"{_f(r['al_sampled_ratio'])} |" for r in rows]
    lines += ["", "![acceptance](compare_acceptance.png) ![drift](compare_drift.png) "
              "![held-out](compare_heldout.png) ![gap](compare_gap.png)"
              + (" ![AL vs context length](compare_al_vs_length.png)" if c.get("context") else "")]
    return "\n".join(lines) + "\n"


def _is_31(drafter: dict) -> bool:
    return bool(drafter.get("fc_norm") and drafter.get("norm_output"))


def compare_seeds(runs31: list[dict], runs3: list[dict]) -> dict:
    """The figures over seeds (JSON-safe) from evaluation/seeds.py ``load_run`` records of each drafter."""
    r31, r3 = [r["report"] for r in runs31], [r["report"] for r in runs3]
    bad = [r["dir"] for r in runs31 if not _is_31(r["drafter"])] + [r["dir"] for r in runs3 if _is_31(r["drafter"])]
    out: dict = {"k": r31[0]["k"], "ttt_steps": r31[0]["ttt_steps"], "temperature": r31[0].get("temperature", 0.0),
                 "seeds": {LABELS[0]: [r["seed"] for r in runs31], LABELS[1]: [r["seed"] for r in runs3]},
                 "runs": {LABELS[0]: [r["dir"] for r in runs31], LABELS[1]: [r["dir"] for r in runs3]},
                 "warnings": warnings(runs31 + runs3) + ([f"not the drafter their side says (flags): {bad}"] if bad
                                                         else []), "sets": {}}
    names = [n for n in r31[0]["sets"] if all(n in r["sets"] for r in r31 + r3)]
    for name in names:
        a, b = set_figures(r31, name), set_figures(r3, name)
        standard = name in EVAL_SETS and not EVAL_SETS.get(name).long
        out["sets"][name] = {LABELS[0]: a, LABELS[1]: b, "paper": PAPER.get(name, STANDARD if standard else None),
                             "ratio": {key: _ratio(a[key]["mean"], b[key]["mean"]) for key, _ in AL_KINDS}}
    sets = out["sets"]
    if "default" in names:
        out["perturbed_vs_default"] = {
            name: {lab: {key: _ratio(sets[name][lab][key]["mean"], sets["default"][lab][key]["mean"])
                         for key, _ in AL_KINDS} for lab in LABELS} for name in PERTURBED_SETS if name in names}
    standard = [n for n in names if sets[n]["paper"] == STANDARD and sets[n]["ratio"]["al"] is not None]
    if standard:  # the paper's 1.10x is a mean over its standard sets
        out["standard_mean_ratio"] = {"sets": standard,
                                      "ratio": sum(sets[n]["ratio"]["al"] for n in standard) / len(standard)}
    out["depth"] = {name: {lab: depth_al([r["sets"][name]["drafter"] for r in reports]) for lab, reports in
                           zip(LABELS, (r31, r3))} for name in names}
    buckets = [{b["bucket"] for b in r.get("context_buckets") or []} for r in r31 + r3]
    common = sorted(set.intersection(*buckets)) if buckets else []
    out["context"] = []
    for bucket in common:
        row: dict = {"bucket": bucket}
        for lab, reports in zip(LABELS, (r31, r3)):
            at = [next(b for b in r["context_buckets"] if b["bucket"] == bucket) for r in reports]
            row[lab] = {"al": spread(b["al"] for b in at), "al_sampled": spread(b.get("al_sampled") for b in at),
                        "lookup_al": spread(b.get("lookup_al") for b in at)}
        row["ratio"] = _ratio(row[LABELS[0]]["al"]["mean"], row[LABELS[1]]["al"]["mean"])
        out["context"].append(row)
    return out


def depth_al(stats: list[dict]) -> list[dict]:
    """AL over seeds at every draft depth k' <= k (greedy, in process): a chain's first k' drafts do not depend on
    k, so AL(k') = 1 + sum of P(accepted >= i) for i <= k' (``accept_at``, engine counting) from one k run."""
    per_seed = [[1 + sum(s["accept_at"][:d]) for d in range(1, len(s["accept_at"]) + 1)] for s in stats]
    return [spread(col) for col in zip(*per_seed)]


def markdown_seeds(c: dict) -> str:
    n31, n3 = len(c["seeds"][LABELS[0]]), len(c["seeds"][LABELS[1]])
    lines = [f"## EAGLE-3.1 vs EAGLE-3 over seeds (chain k={c['k']}, trained K={c['ttt_steps']}; mean ± std over "
             f"{n31} and {n3} seeds; sampled at temperature {c['temperature']})", ""]
    lines += [f"**Warning:** {w}" for w in c["warnings"]] + ([""] if c["warnings"] else [])
    lines += ["| set | AL | EAGLE-3.1 | EAGLE-3 | AL(3.1)/AL(3) | paper |", "|---" * 6 + "|"]
    for name, s in c["sets"].items():
        for key, what in AL_KINDS:
            if s[LABELS[0]][key]["mean"] is None and s[LABELS[1]][key]["mean"] is None:
                continue
            ratio = s["ratio"][key]
            lines.append(f"| {name} | {what} | {cell(s[LABELS[0]][key])} | {cell(s[LABELS[1]][key])} | "
                         f"{'n/a' if ratio is None else f'{ratio:.2f}x'} | {s['paper'] or ''} |")
    lines += ["", "Baselines on the same prompts: prompt lookup's AL (in process, per round: a round without a match "
              "is AL 1; vLLM's ngram where served, per draft: only the rounds that drafted) and the target's "
              "distinct-3-gram ratio (near 0: the target loops and every AL measures the loop):", "",
              "| set | lookup AL (per round) | vLLM ngram AL (per draft) | distinct-3 |", "|---" * 4 + "|"]
    for name, s in c["sets"].items():
        a = s[LABELS[0]]
        lines.append(f"| {name} | {cell(a['lookup_al'])} | {cell(a['lookup_al_engine'])} | {cell(a['distinct3'])} |")
    if c.get("standard_mean_ratio"):
        m = c["standard_mean_ratio"]
        lines += ["", f"Mean AL(3.1)/AL(3) over the standard sets ({', '.join(m['sets'])}), greedy in process: "
                  f"**{m['ratio']:.2f}x** (paper: 1.10x over seven)."]
    if c.get("perturbed_vs_default"):
        lines += ["", "Perturbed over default AL per drafter (1.00: the perturbation does not move the drafter; "
                  "only a perturbation that moves one tests the paper's claim):", "",
                  "| set | AL | EAGLE-3.1 | EAGLE-3 |", "|---" * 4 + "|"]
        for name, p in c["perturbed_vs_default"].items():
            lines += [f"| {name} | {what} | {_f(p[LABELS[0]][key])} | {_f(p[LABELS[1]][key])} |"
                      for key, what in AL_KINDS if p[LABELS[0]][key] is not None or p[LABELS[1]][key] is not None]
    if c.get("depth"):
        k = c["k"]
        shown = sorted({d for d in (2, 3, 5, 7, k, c["ttt_steps"]) if 1 <= d <= k})
        lines += ["", f"Greedy AL by draft depth k' (trained K={c['ttt_steps']}; a chain's first k' drafts do not "
                  f"depend on k, so each k' <= {k} is read off the k={k} run):", "",
                  "| set | " + " | ".join(f"k'={d} 3.1 / 3 (ratio)" for d in shown) + " |", "|---" * (len(shown) + 1)
                  + "|"]
        for name, d in c["depth"].items():
            cells = []
            for j in shown:
                a, b = d[LABELS[0]][j - 1], d[LABELS[1]][j - 1]
                r = _ratio(a["mean"], b["mean"])
                cells.append(f"{cell(a)} / {cell(b)} ({'n/a' if r is None else f'{r:.2f}x'})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if c["context"]:
        lines += ["", "Greedy AL vs context length:", "",
                  "| context tokens | EAGLE-3.1 | EAGLE-3 | AL(3.1)/AL(3) | lookup AL |", "|---" * 5 + "|"]
        lines += [f"| {r['bucket']} | {cell(r[LABELS[0]]['al'])} | {cell(r[LABELS[1]]['al'])} | {_f(r['ratio'])} | "
                  f"{cell(r[LABELS[0]]['lookup_al'])} |" for r in c["context"]]
    return "\n".join(lines) + "\n"


def _legend(ax: Axes, size: int) -> None:
    if ax.get_legend_handles_labels()[0]:  # a report without the figure (a cut eval) draws an empty panel
        ax.legend(fontsize=size)


def _save(fig: Figure, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_bytes_atomic(path, buf.getvalue())


def plots(c: dict, r31: dict, r3: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {LABELS[0]: "-", LABELS[1]: "--"}
    reports = {LABELS[0]: r31, LABELS[1]: r3}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in c["sets"]:
        color = None
        for lab, r in reports.items():
            acc = r["sets"][name]["drafter"]["accept_at"]
            line, = ax.plot(range(1, len(acc) + 1), acc, ls=styles[lab], marker="o", color=color,
                            label=f"{lab} {name}")
            color = line.get_color()
    ax.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1.02), title="Acceptance per position")
    _legend(ax, 7)
    _save(fig, out / "compare_acceptance.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for name in c["sets"]:
        colors = {}
        for lab, r in reports.items():
            d = (r.get("drift") or {}).get(name)
            if not d:
                continue
            for ax, key in zip(axes, ("sink", "context", "drafted", "state_rms")):
                line, = ax.plot(d["depth"], d[key], ls=styles[lab], marker=".", color=colors.get(key),
                                label=f"{lab} {name}")
                colors[key] = line.get_color()
    for ax, t in zip(axes, ("attention on sink", "attention on context", "attention on own drafts", "fed-back RMS")):
        ax.set(xlabel="draft depth", title=t)
    _legend(axes[0], 6)
    _save(fig, out / "compare_drift.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for lab, r in reports.items():
        h = r.get("heldout")
        if h:
            ax.plot(range(h["steps"]), h["acc"], ls=styles[lab], marker="o", label=f"{lab} acc_k")
            ax.plot(range(h["steps"]), h["full_acc"], ls=styles[lab], marker="s", label=f"{lab} full_acc_k")
    ax.axvline(c["ttt_steps"] - 0.5, color="gray", ls=":", label="trained K")
    ax.set(xlabel="step k", ylim=(0, 1.02), title="Held-out teacher-forced accuracy")
    _legend(ax, 7)
    _save(fig, out / "compare_heldout.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for lab, o in c["offline_vs_measured"].items():
        if o:
            ax.plot(range(1, len(o["gap"]) + 1), o["gap"], ls=styles[lab], marker="o", label=lab)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xlabel="draft position", ylabel="measured - offline", title="Offline estimate vs measured acceptance")
    _legend(ax, 7)
    _save(fig, out / "compare_gap.png")
    plt.close(fig)
    if c.get("context"):

        plot_context({lab: r["context_buckets"] for lab, r in reports.items()}, out / "compare_al_vs_length.png",
                     styles)


def plot_depth(c: dict, out: Path) -> None:
    """compare_al_vs_depth.png: greedy AL (mean over seeds, std as bars) against draft depth k', per set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in c["depth"].items():
        color = None
        for lab, ls in zip(LABELS, ("-", "--")):
            pts = [(j + 1, s["mean"], s["std"] or 0.0) for j, s in enumerate(d[lab]) if s["mean"] is not None]
            if pts:
                line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], ls=ls,
                                   marker="o", color=color, capsize=2, label=f"{lab} {name}")
                color = line[0].get_color()
    ax.axvline(c["ttt_steps"], color="gray", ls=":", label="trained K")
    ax.set(xlabel="draft depth k'", ylabel="greedy AL", title="AL by draft depth (mean ± std over seeds)")
    _legend(ax, 6)
    _save(fig, out / "compare_al_vs_depth.png")
    plt.close(fig)


def _write(out: Path, r31: dict, r3: dict, seeds: dict | None = None) -> str:
    """compare.md / compare.json / the plots for the pair (r31, r3), headed by the table over seeds."""
    out.mkdir(parents=True, exist_ok=True)
    c = compare(r31, r3)
    md = markdown(c)
    if seeds is not None:
        c = {"seeds": seeds, "first_seed": c}
        md = (markdown_seeds(seeds) + "\n![AL by depth](compare_al_vs_depth.png)\n\n### The first seed's pair in "
              "detail\n\n" + md.split("\n", 1)[1])
        plot_depth(seeds, out)
    plots(c.get("first_seed", c), r31, r3, out)
    write_json_atomic(out / "compare.json", c)
    write_bytes_atomic(out / "compare.md", md.encode())
    return md


def main(argv: list[str] | None = None, sweep: Callable[..., list[str]] | None = None) -> int:
    """The report from run directories; ``--train`` needs ``sweep``, the pipeline's seeds driver that trains the
    runs first (pipeline/seeds.py ``compare_main``, which ``fledge compare`` runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="After --: Hydra overrides for every "
                                 "run of --train (recipe=NAME ...).")
    ap.add_argument("eagle31_run", type=Path, nargs="?", help="run directory trained with drafter=eagle31")
    ap.add_argument("eagle3_run", type=Path, nargs="?", help="run directory trained with drafter=eagle3")
    ap.add_argument("--eagle31", type=Path, nargs="+", help="EAGLE-3.1 run directories, one per seed")
    ap.add_argument("--eagle3", type=Path, nargs="+", help="EAGLE-3 run directories, one per seed")
    ap.add_argument("--train", type=Path, metavar="ROOT", help="first train both drafters at every --seeds from one "
                    "capture, as run.output_root=ROOT (re-running resumes)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--nproc", type=int, default=1, help="ranks per run of --train (torchrun --nproc_per_node)")
    ap.add_argument("--parallel", type=int, default=1, help="runs of --train at once after the shared capture "
                    "(small drafters on one GPU; each run's output in its sweep.log)")
    ap.add_argument("--partial", action="store_true", help="read an eval cut short from the sets it finished "
                    "(report.partial.json; flagged in the table)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <first EAGLE-3.1 run>/compare, "
                    "with --train ROOT/compare)")
    args = ap.parse_args(argv)
    if args.train:
        if sweep is None:
            ap.error("--train trains the runs: run it as `fledge compare --train ...` (pipeline/seeds.py)")
        if not any(o.startswith("recipe=") for o in overrides):
            ap.error("--train needs the runs' overrides after --, at least recipe=NAME")
        extra = overrides + ([] if any(o.startswith("eval.temperature=") for o in overrides)
                             else ["eval.temperature=1.0"])  # the eval then reports greedy and sampled AL
        dirs = sweep(args.train, [("eagle31", ["drafter=eagle31"]), ("eagle3", ["drafter=eagle3"])], args.seeds,
                     args.nproc, extra, parallel=args.parallel)
        args.eagle31 = [Path(d) for d in dirs if Path(d).name.startswith("eagle31_")]
        args.eagle3 = [Path(d) for d in dirs if Path(d).name.startswith("eagle3_")]
        args.out = args.out or args.train / "compare"
    if args.eagle31 or args.eagle3:
        if not (args.eagle31 and args.eagle3) or args.eagle31_run:
            ap.error("give --eagle31 DIR... and --eagle3 DIR... (one run per seed each), or two run directories")
        runs31 = [load_run(d, args.partial) for d in args.eagle31]
        runs3 = [load_run(d, args.partial) for d in args.eagle3]
        out = args.out or args.eagle31[0] / "compare"
        md = _write(out, runs31[0]["report"], runs3[0]["report"], compare_seeds(runs31, runs3))
    else:
        if not (args.eagle31_run and args.eagle3_run):
            ap.error("give two run directories (EAGLE-3.1, EAGLE-3), --eagle31/--eagle3 runs, or --train ROOT")
        r31, r3 = load_report(args.eagle31_run, True), load_report(args.eagle3_run, False)
        out = args.out or args.eagle31_run / "compare"
        md = _write(out, r31, r3)
    print(md)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
