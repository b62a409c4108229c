"""The eval stage's report: report.json, report.md and PNG plots (matplotlib, Agg backend).

Plots: ``acceptance.png`` (per-position acceptance, drafter vs prompt lookup vs the offline estimate; with
``eval.in_process=false`` the engine's, drafter vs vLLM's ngram), ``drift.png`` (when measured in process:
sink / context / drafted attention mass and fed-back RMS per draft depth),
``heldout.png`` (teacher-forced held-out accuracy per step, the trained K marked), ``al_vs_length.png``
(with ``eval.context_buckets``: AL, drafted-attention mass and fed-back RMS per context length) and, when the train
stage's ``metrics.jsonl`` exists, ``training.png`` (loss_k and acc_k curves, eval/acc_k dashed).
The model card reuses report.md and the PNGs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from fledge.atomic import write_bytes_atomic, write_json_atomic
from fledge.evaluation.engine_eval import engine_markdown
from fledge.models.algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from fledge.run_layout import EvalDir

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# report.md's images, each under its alt text, when plot_report wrote it.
PLOTS = {"acceptance.png": "acceptance", "drift.png": "drift", "heldout.png": "held-out",
         "al_vs_length.png": "AL vs context length"}


def _fmt(x: float | int | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def read_metrics(path: Path) -> list[dict]:
    """The train stage's JSON lines (skipping a torn last line); null values (no data) read as NaN."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append({k: (float("nan") if v is None else v) for k, v in json.loads(line).items()})
        except json.JSONDecodeError:
            continue
    return rows


def markdown(report: dict) -> str:
    """The human summary of a report dict (see evaluation/evaluate.py for its keys)."""
    lines = [f"# Acceptance report ({drafter_kind(report)})", ""]
    if report.get("in_process") is False:  # eval.in_process=false: the engine section below holds every AL
        lines += [_opening(report) + "The prompt sets were measured by the engine alone (eval.in_process=false): "
                  "their ALs, vLLM's n-gram lookup, the distinct-3-gram ratio of the target's output and the greedy "
                  "check are in the engine section below; no in-process harness ran, so there is no in-process AL, "
                  "attention drift or "
                  "offline-vs-measured comparison here. The teacher-forced held-out accuracy is still measured."]
    else:
        lines += in_process_markdown(report)
    if report.get("named_sets"):  # public benchmarks (evaluation/eval_sets.py): where each set's prompts came from
        lines += ["", "## Named eval sets", "",
                  "| set | measures | read from | conversations | prompts | later turns (after the target's own "
                  "answer) | truncated | skipped (too long) | placeholder rows | other-category rows |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, n in report["named_sets"].items():
            lines.append(f"| {name} | {n['measures']} | `{n['source']}` | {n['conversations']} | "
                         f"{n['prompts']} | {n['later_turns']} | {n['truncated']} | "
                         f"{n['skipped_too_long']} | {n['placeholder_rows']} | {n['filtered_rows']} |")
        lines += ["", f"Prompts longer than {next(iter(report['named_sets'].values()))['max_prompt_tokens']} tokens: "
                  f"{next(iter(report['named_sets'].values()))['length_policy']} (truncate keeps the head and the "
                  "tail, cutting the middle)."]
    if report.get("engine"):  # eval.engine=vllm: in-process vs engine side by side (evaluation/engine_eval.py)

        lines += engine_markdown(report)
    if "heldout" in report:
        h = report["heldout"]
        lines += ["", f"## Held-out teacher-forced accuracy (trained K={report['ttt_steps']})", "",
                  "| step | " + " | ".join(str(j) for j in range(h["steps"])) + " |", "|---" * (h["steps"] + 1) + "|",
                  "| acc | " + " | ".join(_fmt(v) for v in h["acc"]) + " |",
                  "| full acc | " + " | ".join(_fmt(v) for v in h["full_acc"]) + " |"]
    if "offline_vs_measured" in report:
        o = report["offline_vs_measured"]
        lines += ["", f"## Offline estimate vs measured ({o['set']} set)", "",
                  f"Offline AL (1 + sum full_acc, held-out) {_fmt(o['offline_al'])}, measured AL "
                  f"{_fmt(o['measured_al'])}; train stage's best estimate {_fmt(report.get('train_al_estimate'))}.", "",
                  "| position | offline full_acc | measured | gap |", "|---|---|---|---|"]
        for i, (a, b, g) in enumerate(zip(o["offline_full_acc"], o["measured_accept_at"], o["gap"])):
            lines.append(f"| {i + 1} | {_fmt(a)} | {_fmt(b)} | {_fmt(g)} |")
    if report.get("drift"):
        lines += ["", "## Attention drift (mean over prompts; depth 0 makes draft 1)", ""]
        for name, d in report["drift"].items():
            lines += [f"{name}:", "", "| depth | sink | context | drafted | fed-back RMS |", "|---|---|---|---|---|"]
            for i, dep in enumerate(d["depth"]):
                lines.append(f"| {dep} | {_fmt(d['sink'][i], 3)} | {_fmt(d['context'][i], 3)} | "
                             f"{_fmt(d['drafted'][i], 3)} | {_fmt(d['state_rms'][i], 3)} |")
            lines.append("")
    if report.get("context_buckets"):
        lines += context_markdown(report["context_buckets"])
    shown = [p for p in report.get("plots", ()) if p in PLOTS]  # the ones written (training.png: write_report)
    lines += [" ".join(f"![{PLOTS[p]}]({p})" for p in shown)]
    return "\n".join(lines) + "\n"


def in_process_markdown(report: dict) -> list[str]:
    """The in-process harness's tables: AL beside prompt lookup and distinct-3 per set, draft-vocab coverage,
    acceptance per position, sampled AL and the greedy check."""
    k = report["k"]
    lines = [_opening(report) + "Prompt lookup = n-gram copy from the context with the same k; its AL here is "
             "per round, a round without a match counting as AL 1 (vLLM counts its ngram method per draft, only the "
             "rounds that drafted: `al_per_draft` in report.json, and the engine section). Degenerate output: "
             f"distinct-3-gram ratio < {report['degenerate_threshold']}.", "",
             "| set | prompts | AL | lookup AL (per round) | AL - lookup | distinct-3 | non-degenerate | "
             "AL (non-deg.) | lookup AL (non-deg.) | speed-up | lookup speed-up | draft s | verify s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["sets"].items():
        d, lk = s["drafter"], s["lookup"]
        lines.append(f"| {name} | {s['prompts']} | {_fmt(d['al'])} | {_fmt(lk['al'])} | {_fmt(s['al_minus_lookup'])} | "
                     f"{_fmt(s['distinct3_mean'])} | {s['non_degenerate_prompts']} | "
                     f"{_fmt(s['drafter_non_degenerate']['al'])} | {_fmt(s['lookup_non_degenerate']['al'])} | "
                     f"{_fmt(d['speedup'])}x | {_fmt(lk['speedup'])}x | {_fmt(d['draft_s'], 1)} | "
                     f"{_fmt(d['verify_s'], 1)} |")
    coverage = {n: s["draft_vocab_coverage"] for n, s in report["sets"].items() if "draft_vocab_coverage" in s}
    if coverage:
        lines += ["", "Share of the target's greedy output tokens in the draft vocab (the drafter can propose no "
                  "other token; the training-time estimate counts the rest as misses): "
                  + ", ".join(f"{n} {_pct(v)}" for n, v in coverage.items()) + "."]
    lines += ["", "Acceptance per position (P(draft i accepted)):", "",
              "| set | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " |", "|---" * (k + 1) + "|"]
    for name, s in report["sets"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(v) for v in s["drafter"]["accept_at"]) + " |")
        lines.append(f"| {name} (lookup) | " + " | ".join(_fmt(v) for v in s["lookup"]["accept_at"]) + " |")
    sampled = {n: s["drafter_sampled"] for n, s in report["sets"].items() if "drafter_sampled" in s}
    if sampled:
        lines += ["", f"Sampled (T={report['temperature']}, rejection sampling): "
                  + ", ".join(f"{n} AL {_fmt(s['al'])}" for n, s in sampled.items())]
    ties = sum(s["greedy_ties"] for s in report["sets"].values())
    return lines + ["", "Greedy output identical to plain greedy decoding on every prompt"
                    + (f" ({ties} divergence(s) at numerical ties of the target's top-2 logits)." if ties else ".")]


def _algorithm(report: dict):
    """The registry entry of the report's drafter (models/algorithms.py); a report written before ``algorithm`` was
    recorded is EAGLE's."""
    return ALGORITHMS.get(report.get("algorithm") or DEFAULT_ALGORITHM)


def drafter_kind(report: dict) -> str:
    """The drafter's algorithm as the report names it: its registry title (P-EAGLE, DFlash, DSpark, MTP), else
    EAGLE-3.1 / EAGLE-3 by its flags."""
    if _algorithm(report).title:
        return _algorithm(report).title
    flags = report["flags"]
    return "EAGLE-3.1" if flags["fc_norm"] and flags["norm_output"] else "EAGLE-3" if not any(flags.values()) \
        else f"fc_norm={flags['fc_norm']}, norm_output={flags['norm_output']}"


def _opening(report: dict) -> str:
    k = report["k"]
    rounds = _algorithm(report).rounds.format(k=k)
    return (f"Drafter `{report['drafter']}`, {rounds} (max AL {k + 1}), greedy unless noted, "
            f"{report['max_new_tokens']} new tokens per prompt. AL counts the bonus token. ")


def context_markdown(buckets: list[dict]) -> list[str]:
    """The AL-vs-context-length table (evaluation/long_context.py): per bucket, AL, prompt lookup and the drift
    figures (attention mass at depth 0, then averaged over the fed-back depths; fed-back RMS)."""
    sampled = any(s.get("al_sampled") is not None for s in buckets)  # eval.temperature > 0
    lines = ["## Acceptance vs context length", "",
             "The same conversations cut to each length (prompt tokens); drift: attention mass on the sink / "
             "context / own drafts averaged over the fed-back depths (depth >= 1), RMS of the fed-back state.", "",
             "| context tokens | prompts | mean prompt | AL | lookup AL | AL (non-deg.) | "
             + ("AL (sampled) | " if sampled else "") + "sink | context | drafted | fed-back RMS |",
             "|---" * (11 if sampled else 10) + "|"]
    for s in buckets:
        d = s["drift"]
        deep = [sum(d[k][1:]) / max(1, len(d[k]) - 1) for k in ("sink", "context", "drafted", "state_rms")]
        lines.append(f"| {s['bucket']} | {s['prompts']} | {_fmt(s['prompt_tokens_mean'], 0)} | {_fmt(s['al'])} | "
                     f"{_fmt(s['lookup_al'])} | {_fmt(s['al_non_degenerate'])} | "
                     + (f"{_fmt(s.get('al_sampled'))} | " if sampled else "")
                     + " | ".join(_fmt(v, 3) for v in deep) + " |")
    return lines + [""]


def plot_context(series: dict[str, list[dict]], path: Path, styles: dict | None = None) -> None:
    """AL (and prompt lookup) vs context length, with drafted-attention mass and fed-back RMS per bucket,
    one line per entry of ``series`` (label -> the report's ``context_buckets``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, buckets in series.items():
        ls = (styles or {}).get(label, "-")
        xs = [s["bucket"] for s in buckets]
        line, = axes[0].plot(xs, [s["al"] for s in buckets], ls=ls, marker="o", label=f"{label} AL")
        axes[0].plot(xs, [s["lookup_al"] for s in buckets], ls=":", color=line.get_color(),
                     label=f"{label} prompt lookup")
        if all(s.get("al_sampled") is not None for s in buckets):  # eval.temperature > 0
            axes[0].plot(xs, [s["al_sampled"] for s in buckets], ls=ls, marker="s", mfc="none",
                         color=line.get_color(), alpha=0.7, label=f"{label} AL (sampled)")
        for ax, key in zip(axes[1:], ("drafted", "state_rms")):
            ax.plot(xs, [sum(s["drift"][key][1:]) / max(1, len(s["drift"][key]) - 1) for s in buckets], ls=ls,
                    marker="o", color=line.get_color(), label=label)
    ticks = sorted({s["bucket"] for buckets in series.values() for s in buckets})
    for ax, title in zip(axes, ("acceptance length", "attention on own drafts (fed-back depths)",
                                "fed-back state RMS")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set(xlabel="context tokens", title=title)
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: never over a line
    _save(fig, path)
    plt.close(fig)


def _save(fig: Figure, path: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_bytes_atomic(path, buf.getvalue())


def plot_report(report: dict, out_dir: Path, metrics: list[dict]) -> list[str]:
    """Write the PNGs; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    k = report["k"]
    pos = list(range(1, k + 1))
    # In process; with eval.in_process=false the engine's counters (per draft), its ngram method the baseline.
    curves = ({name: (s, "lookup") for name, s in report["sets"].items()}
              or {f"{name} (vLLM)": (s, "ngram") for name, s in (report.get("engine") or {}).get("sets", {}).items()})
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (s, baseline) in curves.items():
            line, = ax.plot(pos[:len(s["drafter"]["accept_at"])], s["drafter"]["accept_at"], marker="o",
                            label=f"{name} (AL {_fmt(s['drafter']['al'])})")
            ax.plot(pos[:len(s["lookup"]["accept_at"])], s["lookup"]["accept_at"], ls=":", color=line.get_color(),
                    label=f"{name} {baseline} (AL {_fmt(s['lookup']['al'])})")
        if "offline_vs_measured" in report:
            o = report["offline_vs_measured"]["offline_full_acc"]
            ax.plot(pos[:len(o)], o, ls="--", color="k", label="offline full_acc (held-out)")
        ax.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1.02), title="Acceptance per position")
        ax.legend(fontsize=7)
        _save(fig, out_dir / "acceptance.png")
        plt.close(fig)
        names.append("acceptance.png")
    if report.get("drift"):
        fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
        for name, d in report["drift"].items():
            for ax, key in zip(axes, ("sink", "context", "drafted", "state_rms")):
                ax.plot(d["depth"], d[key], marker="o", label=name)
        for ax, key in zip(axes, ("attention on sink", "attention on context", "attention on own drafts",
                                  "fed-back state RMS")):
            ax.set(xlabel="draft depth", title=key)
        axes[0].legend(fontsize=7)
        _save(fig, out_dir / "drift.png")
        plt.close(fig)
        names.append("drift.png")
    if "heldout" in report:
        h = report["heldout"]
        fig, ax = plt.subplots(figsize=(6, 4))
        steps = list(range(h["steps"]))
        ax.plot(steps, h["acc"], marker="o", label="acc_k")
        ax.plot(steps, h["full_acc"], marker="s", label="full_acc_k")
        ax.axvline(report["ttt_steps"] - 0.5, color="gray", ls="--", label="trained K")
        ax.set(xlabel="step k", ylim=(0, 1.02), title="Held-out teacher-forced accuracy")
        ax.legend(fontsize=7)
        _save(fig, out_dir / "heldout.png")
        plt.close(fig)
        names.append("heldout.png")
    if report.get("context_buckets"):
        plot_context({"drafter": report["context_buckets"]}, out_dir / "al_vs_length.png")
        names.append("al_vs_length.png")
    if metrics:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        train_rows = [m for m in metrics if "loss_0" in m]
        eval_rows = [m for m in metrics if "eval/acc_0" in m]
        for j in range(report["ttt_steps"]):
            if train_rows and f"loss_{j}" in train_rows[0]:
                a1.plot([m["step"] for m in train_rows], [m.get(f"loss_{j}") for m in train_rows], label=f"loss_{j}")
            if train_rows and f"acc_{j}" in train_rows[0]:
                line, = a2.plot([m["step"] for m in train_rows], [m.get(f"acc_{j}") for m in train_rows],
                                label=f"acc_{j}")
                if eval_rows:
                    a2.plot([m["step"] for m in eval_rows], [m.get(f"eval/acc_{j}") for m in eval_rows], ls="--",
                            color=line.get_color(), label=f"eval/acc_{j}")
        a1.set(xlabel="step", title="TTT loss per step")
        a2.set(xlabel="step", title="accuracy per step", ylim=(0, 1.02))
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
        _save(fig, out_dir / "training.png")
        plt.close(fig)
        names.append("training.png")
    return names


def write_report(report: dict, out: EvalDir, metrics_path: Path | None = None) -> None:
    """The report as json and markdown and the PNGs beside them (``out``), each written atomically."""
    metrics = read_metrics(metrics_path) if metrics_path else []
    report["plots"] = plot_report(report, out.root, metrics)
    write_json_atomic(out.report_json, report)
    md = markdown(report)
    if "training.png" in report["plots"]:
        md += "\n![training](training.png)\n"
    write_bytes_atomic(out.report_md, md.encode())
