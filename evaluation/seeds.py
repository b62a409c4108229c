"""Drafters compared over seeds: each variant's eval reports summarised as mean and spread over its seeds.

Used by ``fledge compare`` (evaluation/compare.py: EAGLE-3.1 vs EAGLE-3) and scripts/compare_losses.py (one
variant per training objective). The runs themselves are trained by the pipeline's seeds driver
(pipeline/seeds.py ``sweep``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from fledge.atomic import read_json
from fledge.run_layout import RunLayout


def num(x: float | int | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def spread(values: Iterable[float | int | None]) -> dict:
    """mean and sample standard deviation over seeds (std None with one value), n the values present."""
    vals = [v for v in map(num, values) if v is not None]
    return {"mean": statistics.fmean(vals) if vals else None, "std": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals)}


def per_position(stats: list[dict | None]) -> list[dict]:
    lists = [s["accept_at"] for s in stats if s]
    return [spread(col) for col in zip(*lists)] if lists else []


def cell(s: dict, d: int = 2) -> str:
    """``mean ± std`` (``n/a`` with no value)."""
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean']:.{d}f}" + (f" ± {s['std']:.{d}f}" if s["std"] is not None else "")


def require_in_process(report: dict, path: Path) -> None:
    """SystemExit when the report at ``path`` was measured by the engine alone (eval.in_process=false): the
    comparisons set in-process figures (AL, distinct-3, drift, held-out vs measured) side by side."""
    if report.get("in_process") is False:
        raise SystemExit(f"{path}: measured by the engine alone (eval.in_process=false), without the in-process "
                         "figures a comparison needs; re-run its eval stage with eval.in_process=true")


def require_engine_checks_passed(report: dict, path: Path) -> None:
    """SystemExit when the report at ``path`` failed its engine checks (the eval stage failed on them after
    writing it: evaluation/engine_eval.py): a drafter the engine serves differently from what was measured, or
    one that collapsed, has figures that must not be tabled, let alone averaged over seeds."""
    failures = (report.get("engine") or {}).get("failures") or []
    if failures:
        first = str(failures[0]).splitlines()[0] if str(failures[0]).strip() else "?"
        raise SystemExit(f"{path}: its eval failed {len(failures)} engine check(s) ({first}; the rest in "
                         f"{path.with_suffix('.md').name} beside it), so its figures are not compared; fix the "
                         "drafter or its export and re-run its eval stage")


def load_run(run_dir: Path, partial: bool = False) -> dict:
    """What a summary needs of one run directory (SystemExit naming the missing file): its eval report, its
    train config (drafter, seed), the capture it read, and its training speed. ``partial``: an eval cut short
    is read from the sets it finished (``report.partial.json``, marked ``"partial": true``)."""
    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    report_path = layout.eval.report_json
    if partial and not report_path.exists() and layout.eval.partial_json.exists():
        report_path = layout.eval.partial_json
    report, manifest = read_json(report_path), read_json(layout.manifest("train"))
    if report and report_path == layout.eval.partial_json:
        report["partial"] = True
    for path, got in ((report_path, report), (layout.manifest("train"), manifest)):
        if not got:
            raise SystemExit(f"{path} not found: run the pipeline through the eval stage for {run_dir}")
    require_in_process(report, layout.eval.report_json)
    require_engine_checks_passed(report, report_path)
    config = (manifest.get("inputs") or {}).get("config") or {}
    metrics = layout.train.metrics
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    speeds = [r["tokens_per_s"] for r in records if num(r.get("tokens_per_s"))]
    steps = max((r["step"] for r in records if "step" in r), default=0)
    return {"dir": str(run_dir), "drafter": config.get("drafter") or {}, "seed": (config.get("run") or {}).get("seed"),
            "report": report, "capture": (manifest.get("read") or {}).get("capture"),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "s_per_step": manifest["seconds"] / steps if steps and manifest.get("seconds") else None}


def set_figures(reports: list[dict], name: str) -> dict:
    """One eval set over seeds: greedy and sampled AL in process and in vLLM, the baselines beside them
    (prompt lookup, vLLM's ngram, the target's distinct-3) and acceptance per draft position."""
    per = [r["sets"][name] for r in reports]
    engine = [(((r.get("engine") or {}).get("sets") or {}).get(name)) or {} for r in reports]
    return {
        "al": spread(s["drafter"]["al"] for s in per),
        "al_sampled": spread((s.get("drafter_sampled") or {}).get("al") for s in per),
        "al_engine": spread(e.get("drafter", {}).get("al") for e in engine),
        "al_engine_sampled": spread(e.get("drafter_sampled", {}).get("al") for e in engine),
        "lookup_al": spread(s["lookup"]["al"] for s in per),
        "lookup_al_engine": spread(e.get("lookup", {}).get("al") for e in engine),
        "distinct3": spread(s.get("distinct3_mean") for s in per),
        "accept_at": per_position([s["drafter"] for s in per]),
        "accept_at_sampled": per_position([s.get("drafter_sampled") for s in per]),
        "accept_at_engine": per_position([e.get("drafter") for e in engine]),
        "accept_at_engine_sampled": per_position([e.get("drafter_sampled") for e in engine]),
    }


def warnings(runs: list[dict]) -> list[str]:
    """What makes the runs' figures not comparable."""
    out = []
    if len({(r["report"].get("k"), r["report"].get("ttt_steps")) for r in runs}) > 1:
        out.append("the runs differ in eval k or trained K: their AL do not compare")
    if len({r["capture"] for r in runs}) > 1:
        out.append("the runs read different captures (features): the rows compare data, not only drafters")
    cut = [Path(r["dir"]).name for r in runs if r["report"].get("partial")]
    if cut:
        out.append(f"eval cut short (report.partial.json) in {', '.join(cut)}: only the sets every run finished are "
                   "tabled, and the drift, held-out and context-length figures are missing")
    return out
