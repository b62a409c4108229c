#!/usr/bin/env python
"""A target's own MTP module served by vLLM (``method: mtp``) at k = 1..5: the acceptance per draft position of
the untouched module, the baseline a fine-tuned MTP drafter is measured against (docs/targets.md).

    .venv/bin/python scripts/bench_mtp.py [--target DIR] [--k 1 2 3 4 5] [--prompts 16] [--max-new 96] \
        [--sets eval eval_perturbed long_eval] [--out outputs/bench_mtp.json]

Without ``--target`` it builds (once) and serves the tiny MLA target with an MTP module (``fledge tiny-target
mla_mtp``, testbed/tiny_mtp.py), on the first ``--prompts`` of each tiny eval set. One vLLM driver run (the eval
stage's, fledge.serving.engine) generates greedily in float32 on CPU_MLA attention: plain decoding, then
``speculative_config={"method": "mtp", "num_speculative_tokens": k}`` for each k, every speculative output
compared token for token with the plain one. From vLLM's own counters: AL = 1 + accepted / drafts, and per draft
position i the share of drafts whose first i tokens were all accepted (vLLM's accepted-per-position counter over
drafts). Beside each, in brackets, the same decoding in process with Fledge's module (models/mtp.py, chained as vLLM
chains it): the served module is the one Fledge trains. vLLM runs the one MTP layer k times for k drafts, feeding
back its own normed output, so the positions past the first measure a module trained for one. Prints a markdown
table with the machine and date; writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
               platform.processor())
    isa = "AMX" if "amx_bf16" in info else "AVX-512 bf16" if "avx512_bf16" in info else \
        "AVX-512" if "avx512f" in info else "AVX2"
    return f"{cpu} ({isa}), {os.cpu_count()} cores"


def mtp_request(target: Path, sets: dict[str, list[list[int]]], stop_ids: list[int], ks: list[int],
                max_new: int) -> dict:
    """The eval driver's request: plain greedy (with the top-2 log-prob gaps) and ``method: mtp`` at each k."""
    from fledge.models.layers.mla import CPU_BACKEND

    longest = max(len(p) for prompts in sets.values() for p in prompts)
    return {"target": str(Path(target).resolve()), "dtype": "float32", "attention_backend": CPU_BACKEND,
            "max_model_len": longest + max_new + max(ks) + 16, "seed": 0, "max_new_tokens": max_new,
            "stop_token_ids": stop_ids, "batch_size": 0, "sets": sets,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            "engines": [{"name": "plain", "logprobs": 2}]
            + [{"name": f"mtp_k{k}", "speculative_config": {"method": "mtp", "num_speculative_tokens": k}}
               for k in ks]}


def summarise(result: dict, ks: list[int]) -> dict:
    """Per k and set: AL, acceptance per position, drafts, and the prompts whose output differs from plain's."""
    from fledge.evaluation.engine_eval import TIE_GAP
    from fledge.serving.engine import acceptance, greedy_differences

    plain = result["engines"]["plain"]["sets"]
    out = {}
    for k in ks:
        sets = result["engines"][f"mtp_k{k}"]["sets"]
        out[k] = {name: {**acceptance(s["counters"], k),
                         "differences": greedy_differences(s["outputs"], plain[name]["outputs"],
                                                           plain[name]["top2_gaps"], TIE_GAP["float32"]),
                         "tokens": s["tokens"], "wall_s": s["wall_s"], "plain_wall_s": plain[name]["wall_s"]}
                  for name, s in sets.items()}
    return out


def in_process(target: Path, sets: dict[str, list[list[int]]], stop_ids: list[int], ks: list[int],
               max_new: int) -> dict:
    """The same decoding in process (testbed/tiny_mtp.py chain_acceptance: models/mtp.py chained as vLLM chains
    it, fp32 from the saved weights): per k and set, AL and acceptance per position as vLLM counts them."""
    import torch
    from transformers import AutoModelForCausalLM

    from fledge.models.mtp import load_mtp
    from fledge.serving.engine import acceptance
    from fledge.testbed.tiny_mtp import chain_acceptance

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    mtp = load_mtp(target)
    return {k: {name: acceptance(chain_acceptance(model, mtp, prompts, k, max_new, stop_ids), k)
                for name, prompts in sets.items()} for k in ks}


def table(figures: dict, inproc: dict, sets: list[str]) -> str:
    """Served AL and acceptance per position (in process in brackets), drafts, and equality with plain."""
    k_max = max(figures)
    head = "| set | k | AL | " + " | ".join(f"pos {i}" for i in range(1, k_max + 1)) + " | drafts | equal to plain |"
    rows = [head, "|" + "---|" * (k_max + 5)]
    for name in sets:
        for k, per_set in figures.items():
            f, g = per_set[name], inproc[k][name]
            cells = [f"{a:.3f} ({b:.3f})" for a, b in zip(f["accept_at"], g["accept_at"])] + [""] * (k_max - k)
            rows.append(f"| {name} | {k} | {f['al']:.2f} ({g['al']:.2f}) | " + " | ".join(cells)
                        + f" | {f['drafts']} | {'yes' if not f['differences'] else f['differences']} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=None, help="a target with num_nextn_predict_layers (default: "
                                                              "the tiny mla_mtp, built once under .cache)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--sets", nargs="+", default=["eval", "eval_perturbed", "long_eval"])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_mtp.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from fledge.engine_process import engine_python
    from fledge.serving.engine import run_driver
    from fledge.testbed import targets, tiny_writer

    target = args.target or targets.build("mla_mtp")
    tok = AutoTokenizer.from_pretrained(target)
    data = tiny_writer.build_data()
    sets = {name: [ids for ids, _ in tiny_writer.prompts(tok, data, name, args.prompts)] for name in args.sets}
    req = mtp_request(target, sets, [tok.eos_token_id], args.k, args.max_new)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run_driver("vllm", engine_python(), req, args.out.parent / "bench_mtp_engine", 3600)
    figures = summarise(result, args.k)
    inproc = in_process(target, sets, [tok.eos_token_id], args.k, args.max_new)
    when = datetime.date.today().isoformat()
    report = {"target": str(target), "machine": machine(), "engine_device": result["device"], "date": when,
              "vllm": result["vllm_version"], "prompts": args.prompts, "max_new_tokens": args.max_new,
              "figures": figures, "in_process": inproc}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{target}: vLLM {result['vllm_version']} method mtp, float32, {args.prompts} prompts x {args.max_new} "
          f"tokens per set; {machine()}; {when}\n")
    print(table(figures, inproc, args.sets))
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
