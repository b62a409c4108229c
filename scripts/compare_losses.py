"""Training objectives compared: drafters trained one per loss x seed from the same prepared data and
features, then one table of what each objective buys (as `fledge compare` does for EAGLE-3.1 vs EAGLE-3).

    # train every loss x seed (a base run prepares and captures once; the others link its prepare/ and capture/)
    python scripts/compare_losses.py run --root outputs/losses --losses ttt_ce tv lk_lambda mix:ttt_ce=0.5,tv=0.5 \\
        --seeds 0 1 2 --nproc 2 -- recipe=tiny
    # or only the table, from run directories (LABEL=DIR names a run's group; default: its loss)
    python scripts/compare_losses.py table outputs/losses/ttt_ce_s0 outputs/losses/tv_s0 ... --out outputs/losses

``run`` is pipeline/seeds.py's ``sweep``: ``<root>/base`` prepares and captures once, then per loss and seed
``<root>/<loss>_s<seed>`` trains, exports and evaluates with run.seed=<seed> and the loss, its ``prepare`` and
``capture`` symlinked to the base's; eval.temperature=1.0 unless the overrides set it (greedy and sampled AL).
Re-running the command resumes. A loss is a registered name or ``mix:name=w,name=w``.

``table`` reads each run's <run>/eval/report.json (evaluation/evaluate.py), <run>/train/manifest.json (its loss and
seed) and train/metrics.jsonl, groups the runs by loss and writes compare_losses.md (also printed) and
compare_losses.json to ``--out``. Per group: the seeds; per eval set the greedy and sampled (rejection
sampling) AL in-process and, where the eval served vLLM, in the engine, with the prompt-lookup AL (in
process and vLLM's ngram) and the target's distinct-3 beside them, as mean +- sample standard deviation
over seeds; acceptance per draft position (greedy and sampled, in process and vLLM); the training cost per step:
tokens/s (median of a run's logged steps, mean over seeds) and seconds per step, and the slowdown against
the ``ttt_ce`` group. Runs that did not read the same capture are flagged: their rows compare features too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fledge.atomic import write_bytes_atomic, write_json_atomic
from fledge.evaluation.seeds import cell, load_run, set_figures, spread, warnings
from fledge.pipeline.seeds import sweep

BASELINE = "ttt_ce"


# ------------------------------------------------------------------------------------------------- reading
def loss_label(drafter: dict) -> str:
    """The group a run belongs to, from its train config's drafter section: the loss with what it reads
    (``jsd(beta=0.3)``, ``lk_lambda(eta=3.0)``, ``mix(ttt_ce=0.5,tv=0.5)``)."""
    name, opts = drafter.get("loss", BASELINE), drafter.get("loss_options") or {}
    if name == "mix":
        return "mix(" + ",".join(f"{n}={w:g}" for n, w in sorted((drafter.get("loss_mix") or {}).items())) + ")"
    if name == "jsd":
        return f"jsd(beta={opts.get('jsd_beta', 0.5):g})"
    if name == "lk_lambda":
        return f"lk_lambda(eta={opts.get('lk_eta', 3.0):g})"
    return name


def labelled(run_dir: Path, label: str | None = None) -> dict:
    """One run's figures (evaluation/seeds.py), grouped by ``label`` or by its loss."""
    r = load_run(run_dir)
    return {**r, "label": label or loss_label(r["drafter"])}


# -------------------------------------------------------------------------------------------------- figures
def summarise(runs: list[dict]) -> dict:
    """The table's figures (JSON-safe), groups in first-seen order, the baseline's first."""
    groups: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["label"] != BASELINE):
        groups.setdefault(r["label"], []).append(r)
    first = runs[0]["report"]
    out: dict = {"k": first.get("k"), "ttt_steps": first.get("ttt_steps"), "temperature": first.get("temperature"),
                 "order": list(groups), "groups": {}, "warnings": warnings(runs)}
    for label, rs in groups.items():
        sets = [n for n in rs[0]["report"]["sets"] if all(n in r["report"]["sets"] for r in rs)]
        out["groups"][label] = {"seeds": [r["seed"] for r in rs], "runs": [r["dir"] for r in rs],
                                "sets": {n: set_figures([r["report"] for r in rs], n) for n in sets},
                                "tokens_per_s": spread(r["tokens_per_s"] for r in rs),
                                "s_per_step": spread(r["s_per_step"] for r in rs)}
    base = (out["groups"].get(BASELINE) or {}).get("tokens_per_s", {}).get("mean")
    for g in out["groups"].values():
        tps = g["tokens_per_s"]["mean"]
        g["cost_vs_baseline"] = base / tps if base and tps else None
    return out


# ------------------------------------------------------------------------------------------------- markdown
def markdown(c: dict) -> str:
    groups = {label: c["groups"][label] for label in c["order"]}
    sets = list(dict.fromkeys(n for g in groups.values() for n in g["sets"]))
    lines = [f"## Training objectives (chain k={c['k']}, trained K={c['ttt_steps']}; mean ± std over seeds)", ""]
    lines += [f"**Warning:** {w}" for w in c["warnings"]] + ([""] if c["warnings"] else [])
    # Per set, each AL with the baselines beside it: prompt lookup (in process and vLLM's ngram) and the
    # target's distinct-3 (a looping target inflates every AL, lookup's too).
    columns = (("al", "AL greedy"), ("al_sampled", "AL sampled"), ("al_engine", "AL vLLM greedy"),
               ("al_engine_sampled", "AL vLLM sampled"), ("lookup_al", "lookup AL"),
               ("lookup_al_engine", "vLLM ngram AL"), ("distinct3", "distinct-3"))
    head = ["loss", "seeds"] + [f"{n} {what}" for n in sets for _, what in columns]
    head += ["tokens/s", "s/step", f"cost vs {BASELINE}"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, g in groups.items():
        row = [label, str(len(g["seeds"]))]
        row += [cell(g["sets"][n][key]) if n in g["sets"] else "n/a" for n in sets for key, _ in columns]
        cost = g["cost_vs_baseline"]
        row += [cell(g["tokens_per_s"], 0), cell(g["s_per_step"]), "n/a" if cost is None else f"{cost:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    for key, what in (("accept_at", "greedy"), ("accept_at_sampled", f"sampled, temperature {c['temperature']}"),
                      ("accept_at_engine", "greedy, vLLM"),
                      ("accept_at_engine_sampled", f"sampled, temperature {c['temperature']}, vLLM")):
        rows = [(n, label, g["sets"][n][key]) for n in sets for label, g in groups.items()
                if n in g["sets"] and g["sets"][n][key]]
        if not rows:
            continue
        k = max(len(p) for _, _, p in rows)
        lines += ["", f"Acceptance per draft position ({what}): P(draft i accepted)", "",
                  "| set | loss | " + " | ".join(str(i + 1) for i in range(k)) + " |", "|---" * (k + 2) + "|"]
        lines += [f"| {n} | {label} | " + " | ".join(cell(s) for s in p) + " |" for n, label, p in rows]
    lines += ["", "Cost: tokens/s is the median of a run's logged training steps, s/step the train stage's wall "
              f"time over its steps (evals and checkpoints included); cost vs {BASELINE} = its tokens/s over this "
              "loss's."]
    return "\n".join(lines) + "\n"


def table(args) -> int:
    runs = []
    for spec in args.runs:
        label, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
        runs.append(labelled(Path(path), label or None))
    if not runs:
        raise SystemExit("no run directories given")
    c = summarise(runs)
    md = markdown(c)
    out = args.out or Path(runs[0]["dir"]).parent
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compare_losses.json", c)
    write_bytes_atomic(out / "compare_losses.md", md.encode())
    print(md)
    print(f"written to {out}")
    return 0


# ------------------------------------------------------------------------------------------------- training
def loss_overrides(spec: str) -> tuple[str, list[str]]:
    """(the run-name part, the overrides) of a loss given as ``name`` or ``mix:name=w,name=w``."""
    name, _, parts = spec.partition(":")
    if name != "mix":
        if parts:
            raise SystemExit(f"--losses {spec}: only mix takes parts (mix:ttt_ce=0.5,tv=0.5)")
        return name, [f"drafter.loss={name}"]
    weights = dict(p.split("=", 1) for p in parts.split(",") if p)
    if not weights:
        raise SystemExit(f"--losses {spec}: name the parts of the mix, e.g. mix:ttt_ce=0.5,tv=0.5")
    tag = "mix_" + "_".join(f"{n}{w}" for n, w in weights.items())
    return tag, ["drafter.loss=mix", "+drafter.loss_mix={" + ", ".join(f"{n}: {w}" for n, w in weights.items()) + "}"]


def run(args) -> int:
    extra = list(args.overrides)
    if not any(o.startswith("eval.temperature=") for o in extra):
        extra.append("eval.temperature=1.0")  # the eval then reports greedy and sampled AL
    dirs = sweep(args.root, [loss_overrides(s) for s in args.losses], args.seeds, args.nproc, extra)
    return table(argparse.Namespace(runs=dirs, out=args.out or args.root.resolve()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="the table from run directories")
    t.add_argument("runs", nargs="+", help="run directories, or LABEL=DIR")
    t.add_argument("--out", type=Path, default=None, help="output directory (default: the first run's parent)")
    r = sub.add_parser("run", help="train every loss x seed from one capture, then the table")
    r.add_argument("--root", type=Path, default=Path("outputs/losses"), help="run.output_root of every run")
    r.add_argument("--losses", nargs="+", default=[BASELINE, "tv", "lk_lambda"], help="names, or mix:name=w,name=w")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --nproc_per_node)")
    r.add_argument("--out", type=Path, default=None, help="where the table goes (default: --root)")
    r.add_argument("overrides", nargs="*", help="Hydra overrides for every run, after --")
    args = ap.parse_args(argv)
    return table(args) if args.cmd == "table" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
