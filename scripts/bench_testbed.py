"""Benchmark the tiny recipe's target (testbed/tiny_writer.py) on this machine, in one run: build time,
held-out loss and top-1, and per eval set (default, perturbed, long) the greedy distinct-3, the share of
non-degenerate prompts, how many prompts give distinct continuations and the share of prompt pairs that
share one, and prompt lookup's AL; with
``--report`` (a finished recipe run's eval/report.json, e.g. ``torchrun ... train/main.py recipe=tiny``), the
drafter's AL and speed-up beside prompt lookup's on that report's prompts, as ratios. The baseline of each table is
prompt lookup, measured on the same target and prompts.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_testbed.py                        # fresh build in a temp dir
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_testbed.py                    # as an AVX2-only CPU
    .venv/bin/python scripts/bench_testbed.py --root .cache/tiny_target --report runs/tiny/eval/report.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def lookup_al(path: Path, data_dir: Path, name: str, k: int = 5) -> float:
    """Prompt lookup's AL (n <= 3, k drafts, greedy, to the end of the answer) on eval set ``name``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fledge.evaluation.speculative import LookupProposer, TargetRunner, speculative_decode
    from fledge.testbed import tiny_writer

    tok = AutoTokenizer.from_pretrained(path)
    runner = TargetRunner(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    tokens = rounds = 0
    with torch.no_grad():
        for ids, _ in tiny_writer.prompts(tok, data_dir, name):
            res = speculative_decode(runner, LookupProposer(3), ids, k, tiny_writer.GEN_TOKENS, [tok.eos_token_id])
            tokens, rounds = tokens + len(res.tokens), rounds + len(res.rounds)
    return tokens / max(1, rounds)


def main() -> None:
    from fledge.testbed import tiny_writer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=None, help="build (or reuse) here; default: a fresh temp dir")
    ap.add_argument("--steps", type=int, default=None, help="override the step count")
    ap.add_argument("--report", type=Path, default=None, help="a recipe run's eval/report.json")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cached = (Path(args.root or tmp) / "llama" / "build.json").exists()
        t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
        path = tiny_writer.build_target("llama", args.root or Path(tmp), args.steps)
        wall, r1 = time.time() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        m = json.loads((path / "metrics.json").read_text())
        for name in tiny_writer.SETS:
            m[name]["lookup_al"] = lookup_al(path, path.parent / "data", name)
    print(f"machine: {m['cpu']}, {m['torch_threads']} threads, ISA limit "
          f"{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}, {time.strftime('%Y-%m-%d')}")
    reused = "reused a cached build, " if cached else ""
    print(f"build: {reused}{wall:.0f} s wall, {cpu:.0f} CPU-s (train {m['train_seconds']:.0f} s, "
          f"{m['train_cpu_seconds']:.0f} CPU-s, {m['steps']} steps of {m['batch_size']} x {m['seq_len']}); "
          f"{m['parameters'] / 1e6:.1f}M params")
    print(f"held-out loss {m['heldout_loss']:.3f}, top-1 {m['heldout_top1']:.1%} ({m['heldout_tokens']} answer tokens)")
    print("| set | prompts | distinct-3 | non-degenerate | distinct outputs | pairs sharing | exact answers | "
          "lookup AL |\n|---" + "|---" * 7 + "|")
    for name in tiny_writer.SETS:
        s = m[name]
        key = {"eval": "default", "eval_perturbed": "perturbed", "long_eval": "long"}[name]
        print(f"| {key} | {s['prompts']} | {s['distinct3']:.2f} | {s['non_degenerate']:.0%} | "
              f"{s['distinct_outputs']:.0%} | {s['pairs_sharing']:.1%} | {s['exact_answers']:.0%} | "
              f"{s['lookup_al']:.2f} |")
    if args.report:  # the recipe's own sets (its long set: held-out answers before a question, not tables)
        print(f"\n{args.report}:\n| set | drafter AL | lookup AL | AL / lookup | drafter speed-up | lookup speed-up |"
              "\n|---" + "|---" * 5 + "|")
        for key, r in json.loads(args.report.read_text())["sets"].items():
            d, lk = r["drafter"], r["lookup"]
            print(f"| {key} | {d['al']:.2f} | {lk['al']:.2f} | {d['al'] / lk['al']:.2f}x | {d['speedup']:.2f}x | "
                  f"{lk['speedup']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({**m, "build_wall_seconds": wall, "build_cpu_seconds": cpu}, indent=1))


if __name__ == "__main__":
    main()
