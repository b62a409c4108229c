#!/usr/bin/env python
"""Attention drift in a target's MTP module, chained as vLLM 0.32 chains it (docs/mtp.md): the eval stage's drift
probe (evaluation/drift.py) per draft depth, on the target's own module, on fine-tuned MTP exports and on EAGLE-3.1
drafters trained for the same target.

    .venv/bin/python scripts/mtp_drift.py [--target DIR] [--drafter NAME=EXPORT_DIR ...] [--prompts 16] \
        [--depth 6] [--out outputs/mtp_drift]

Each module is probed in two chains: the one vLLM 0.32 serves (``shared_head.norm(out)`` fed to the next draft:
deepseek_mtp.py returns it beside ``out`` and the proposer feeds it) and the pre-norm one (``out`` fed back, what
vLLM fed before it returned the pair, and how DeepSeek-V3's sequential modules pass their states). Per depth (0
makes draft 1, from the target's final normed state): the attention mass on the first token (sink), on the other
committed rows (context) and on the drafts of the round, and the RMS of the state fed in; an EAGLE-3.1 drafter is
probed in the chain it is served in, and a NAME given more than once is averaged over its seeds. Without ``--target`` it
uses the tiny MLA target with an MTP module (``fledge tiny-target mla_mtp``) and the first ``--prompts`` of the tiny
default eval set, rendered with the target's chat template. Prints markdown tables with the machine and date;
writes drift.json and drift.png (the eval report's plot) under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prompts(target: Path, data: Path, n: int) -> list[list[int]]:
    """The first ``n`` conversations of ``data`` up to their last user turn, rendered as the eval stage renders them."""
    from transformers import AutoTokenizer

    from fledge.atomic import read_jsonl
    from fledge.data.prepare.chat import ChatRenderer, prompt_ids
    from fledge.evaluation.prompt_sets import prompt_upto

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(target))
    return [prompt_ids(renderer, c, prompt_upto(c)) for c in read_jsonl(data, "build the tiny data")[:n]]


def chains(drafter):
    """An MTP module as vLLM 0.32 chains it, and the same weights chained pre-norm; any other drafter (an
    EAGLE-3.1 one trained for the same target, the same size's baseline) as it is served."""
    from fledge.models.mtp_drafter import MtpDrafter

    if not isinstance(drafter, MtpDrafter):
        return {"as served": drafter.eval()}
    pre = MtpDrafter(dataclasses.replace(drafter.spec, norm_output=False))
    pre.load_state_dict(drafter.state_dict())
    return {"vLLM chain (post-norm)": drafter.eval(), "pre-norm chain": pre.eval()}


def mean_curves(runs: list[dict]) -> dict:
    """The seeds' drift curves averaged per depth (``seeds``: how many)."""
    keys = ("sink", "context", "drafted", "state_rms")
    return {**runs[0], "seeds": len(runs), **{k: [sum(r[k][i] for r in runs) / len(runs)
                                                  for i in range(len(runs[0][k]))] for k in keys}}


def table(name: str, d: dict) -> list[str]:
    lines = [f"{name} ({d['seeds']} seed{'s' * (d['seeds'] > 1)}):", "",
             "| depth | sink | context | drafted | fed-in RMS |", "|---|---|---|---|---|"]
    for i, dep in enumerate(d["depth"]):
        lines.append(f"| {dep} | " + " | ".join(f"{d[k][i]:.3f}" for k in ("sink", "context", "drafted", "state_rms"))
                     + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="a target with an MTP layer (default: the tiny mla_mtp one)")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help="an export trained for the target: a fine-tuned MTP module or an EAGLE-3.1 drafter (a NAME "
                         "repeated: its seeds, averaged per depth)")
    ap.add_argument("--data", type=Path, help="eval conversations (default: the tiny data's eval.jsonl)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("outputs/mtp_drift"))
    args = ap.parse_args()
    if any("=" not in d or not (Path(d.split("=", 1)[1]) / "config.json").exists() for d in args.drafter):
        ap.error("--drafter takes NAME=DIR, DIR an export with a config.json")

    import torch
    from transformers import AutoModelForCausalLM

    from fledge.evaluation.drift import drift_curves
    from fledge.evaluation.report import plot_report
    from fledge.evaluation.speculative import TargetRunner
    from fledge.serving.export import load_drafter
    from fledge.testbed import targets, tiny_writer

    target = args.target or targets.build("mla_mtp")
    data = args.data or tiny_writer.build_data() / "eval.jsonl"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ps = prompts(target, data, args.prompts)
    modules = [("target's own", str(target))] + [tuple(d.split("=", 1)) for d in args.drafter]
    seeds: dict[str, list[dict]] = {}
    for name, where in modules:
        drafter = load_drafter(where, target=target, serving=True)
        runner = TargetRunner(model, drafter.spec.aux_layer_ids)
        for chain, d in chains(drafter).items():
            seeds.setdefault(f"{name}, {chain}", []).append(drift_curves(d, runner, ps, args.depth,
                                                                         desc=f"{name}, {chain}"))
    curves = {name: mean_curves(runs) for name, runs in seeds.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drift.json").write_text(json.dumps(curves, indent=1))
    plot_report({"k": 1, "sets": {}, "drift": curves}, args.out, [])
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"# MTP drift: {target}, {len(ps)} prompts of {data.name}, depth {args.depth} ({cpu}, "
          f"{datetime.date.today()})\n")
    for name, d in curves.items():
        print("\n".join(table(name, d)))
    print(f"wrote {args.out / 'drift.json'} and {args.out / 'drift.png'}")


if __name__ == "__main__":
    main()
