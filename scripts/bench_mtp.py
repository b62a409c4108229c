#!/usr/bin/env python
"""A target's own MTP module and drafters trained for it, served by vLLM at k = 1..5 beside n-gram lookup: the
acceptance per draft position, the speed-up and the distinct-3-gram ratio, over seeds (docs/targets.md,
docs/mtp.md).

    .venv/bin/python scripts/bench_mtp.py [--target DIR] [--drafter NAME=EXPORT_DIR ...] [--k 1 2 3 4 5] \
        [--prompts 16] [--max-new 96] [--sets eval eval_perturbed long_eval] [--out outputs/bench_mtp.json]

Without ``--target`` it builds (once) and serves the tiny MLA target with an MTP module (``fledge tiny-target
mla_mtp``, testbed/tiny_mtp.py), on the first ``--prompts`` of each tiny eval set. One vLLM driver run (the eval
stage's, fledge.serving.engine) generates greedily in float32 on CPU_MLA attention: plain decoding, then for each k
the target's own module (``speculative_config={"method": "mtp", "num_speculative_tokens": k}``), n-gram lookup, and
every ``--drafter`` export as its config.json says it is served (serving_config.py: a ``drafter=mtp`` export with
method mtp from its directory, an EAGLE-3 one with eagle3); each speculative output is compared token for token
with the plain one. A NAME given more than once is one drafter trained with several seeds: its figures are the mean,
with the spread (max - min) beside. From vLLM's own counters: AL = 1 + accepted / drafts, and per draft position i
the share of drafts whose first i tokens were all accepted. Beside the MTP modules' AL, in brackets, the same
decoding in process with Fledge's module (models/mtp.py, chained as vLLM chains it); for an export trained with
``drafter.norm_output=false`` also the pre-norm chain it was trained for, which vLLM 0.32 cannot serve. vLLM runs
the one MTP layer k times for k drafts, feeding back its own normed output, so the untouched module's positions past
the first measure a module trained for one. Prints markdown tables with the machine and date; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
OWN = "target's own module"


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
               platform.processor())
    isa = "AMX" if "amx_bf16" in info else "AVX-512 bf16" if "avx512_bf16" in info else \
        "AVX-512" if "avx512f" in info else "AVX2"
    return f"{cpu} ({isa}), {os.cpu_count()} cores"


def served(name: str, k: int, drafter: Path | None = None) -> dict:
    """The driver's engine entry for one drafter at k: the target's own module without ``drafter``, ngram
    for NAME ``ngram``, else the export as serving_config.py serves it (with the CPU draft options)."""
    from fledge.models.layers.mla import CPU_BACKEND
    from fledge.serving.engine import draft_options, speculative_config

    if drafter is not None:
        config = {**speculative_config("eagle3", k, drafter), **draft_options(drafter, "cpu")}
    elif name == "ngram":
        config = speculative_config("ngram", k)
    else:  # the target's own module: MLA attention like the target's (AMX_MLA, vLLM's pick on AMX, is bf16 only)
        config = {"method": "mtp", "num_speculative_tokens": k, "attention_backend": CPU_BACKEND}
    return {"name": f"{name}@k{k}", "speculative_config": config}


def mtp_request(target: Path, sets: dict[str, list[list[int]]], stop_ids: list[int], ks: list[int],
                max_new: int, drafters: list[tuple[str, Path]] = (), ngram: bool = False) -> dict:
    """The eval driver's request: plain greedy (with the top-2 log-prob gaps), then per k the target's own
    module (method mtp) and each (label, export) of ``drafters``; with ``ngram``, n-gram lookup at k = ks[0]
    alone (vLLM 0.32 on CPU builds no engine after an ngram one in the same process: its
    register_triton_kernel_overrides fails, '_lib_fn_wrapper' object has no attribute 'get'; the eval stage
    runs its lookup last for the same reason)."""
    from fledge.models.layers.mla import CPU_BACKEND

    longest = max(len(p) for prompts in sets.values() for p in prompts)
    engines = [served("ngram", ks[0])] if ngram else \
        [served(OWN, k) for k in ks] + [served(label, k, d) for label, d in drafters for k in ks]
    return {"target": str(Path(target).resolve()), "dtype": "float32", "attention_backend": CPU_BACKEND,
            "max_model_len": longest + max_new + max(ks) + 16, "seed": 0, "max_new_tokens": max_new,
            "stop_token_ids": stop_ids, "batch_size": 0, "sets": sets,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            "engines": [{"name": "plain", "logprobs": 2}] + engines}


def summarise(result: dict, ks: list[int], name: str = OWN) -> dict:
    """Per k and set, for the engine ``name``: AL, acceptance per position, drafts, tokens per second against
    plain decoding's, and the prompts whose output differs from plain's."""
    from fledge.evaluation.engine_eval import TIE_GAP
    from fledge.serving.engine import acceptance, greedy_differences

    plain = result["engines"]["plain"]["sets"]
    out = {}
    for k in ks:
        sets = result["engines"][f"{name}@k{k}"]["sets"]
        out[k] = {s_name: {**acceptance(s["counters"], k),
                           "differences": greedy_differences(s["outputs"], plain[s_name]["outputs"],
                                                             plain[s_name]["top2_gaps"], TIE_GAP["float32"]),
                           "tokens": s["tokens"], "wall_s": s["wall_s"], "plain_wall_s": plain[s_name]["wall_s"],
                           "speedup": (s["tokens"] / s["wall_s"]) / (plain[s_name]["tokens"] / plain[s_name]["wall_s"])}
                  for s_name, s in sets.items()}
    return out


def module_of(target: Path, export: Path | None, pre_norm: bool = False):
    """The MTP module vLLM serves: the target's own, or ``export``'s ``model.layers.{L}.*`` on the target's
    embedding and head; with ``pre_norm`` chained feeding ``out`` back instead of ``shared_head.norm(out)``."""
    from transformers import AutoConfig

    from fledge.models.mtp import load_mtp, module_state_dict
    from fledge.models.weights import read_tensors

    mtp = load_mtp(target)
    if export is not None:
        layers = AutoConfig.from_pretrained(target).num_hidden_layers
        missing, unexpected = mtp.load_state_dict(module_state_dict(read_tensors(export), layers), strict=False)
        missing = [n for n in missing if not n.startswith(("embed_tokens.", "shared_head.head."))]
        if missing or unexpected:  # else the target's own tensors would stand in, without a word
            raise SystemExit(f"bench_mtp: {export}: its model.layers.{layers}.* do not make the target's MTP module "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]}); run `fledge lint {export}`")
    if pre_norm:
        mtp.feedback = lambda out: out  # the pre-norm chain (docs/mtp.md), what norm_output=false trains
    return mtp


def in_process(model, mtp, sets: dict[str, list[list[int]]], stop_ids: list[int], ks: list[int],
               max_new: int) -> dict:
    """The same decoding in process with the target ``model`` (testbed/tiny_mtp.py chain_acceptance: the module
    chained as vLLM chains it, fp32 from the saved weights): per k and set, AL and acceptance per position as vLLM
    counts them."""
    from fledge.serving.engine import acceptance
    from fledge.testbed.tiny_mtp import chain_acceptance

    return {k: {name: acceptance(chain_acceptance(model, mtp, prompts, k, max_new, stop_ids), k)
                for name, prompts in sets.items()} for k in ks}


def over_seeds(runs: list[dict], key: str, i: int | None = None) -> tuple[float, float]:
    """Mean and spread (max - min) of ``key`` (its i-th entry) over the seeds' figures."""
    vals = [r[key] if i is None else r[key][i] for r in runs]
    return sum(vals) / len(vals), max(vals) - min(vals)


def cell(runs: list[dict], key: str, i: int | None = None, fmt: str = ".2f") -> str:
    mean, spread = over_seeds(runs, key, i)
    return f"{mean:{fmt}}" + (f" ±{spread / 2:{fmt}}" if len(runs) > 1 else "")


def table(figures: dict, inproc: dict, set_name: str, ks: list[int]) -> str:
    """Per drafter and k: served AL (in process in brackets, for MTP modules), acceptance per position,
    speed-up against plain decoding, and whether every seed's output equals plain decoding's. ``figures``:
    {drafter: [per seed {k: {set: figures}}]}; ``inproc``: {drafter: [per seed {chain: {k: {set: ...}}}]}."""
    k_max = max(ks)
    rows = ["| drafter | seeds | k | AL (in process) | " + " | ".join(f"pos {i}" for i in range(1, k_max + 1))
            + " | speed-up | equal to plain |", "|" + "---|" * (k_max + 6)]
    for name, seeds in figures.items():
        for k in ks:
            runs = [s[k][set_name] for s in seeds]
            chains = [(f"{chain} chain " if chain else "") + cell([s[k][set_name] for s in per_seed], "al")
                      for chain, per_seed in (inproc.get(name) or {}).items()]
            al = cell(runs, "al") + (f" ({'; '.join(chains)})" if chains else "")
            pos = [cell(runs, "accept_at", i, ".3f") for i in range(k)] + [""] * (k_max - k)
            equal = "yes" if not any(d for r in runs for d in r["differences"] if not d["tie"]) else "NO"
            rows.append(f"| {name} | {len(seeds)} | {k} | {al} | " + " | ".join(pos)
                        + f" | {cell(runs, 'speedup')}x | {equal} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=None, help="a target with num_nextn_predict_layers (default: "
                                                              "the tiny mla_mtp, built once under .cache)")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help="an export trained for the target (a NAME repeated: its seeds)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--sets", nargs="+", default=["eval", "eval_perturbed", "long_eval"])
    ap.add_argument("--out", type=Path, default=Path("outputs/bench_mtp.json"))
    args = ap.parse_args()
    named = [d.split("=", 1) for d in args.drafter]
    if any(len(n) != 2 or not (Path(n[1]) / "config.json").exists() for n in named):
        ap.error("--drafter takes NAME=DIR, DIR an export with a config.json")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fledge.engine_process import engine_python
    from fledge.evaluation.acceptance import distinct_ngram_ratio
    from fledge.serving.engine import run_driver
    from fledge.testbed import targets, tiny_writer

    target = args.target or targets.build("mla_mtp")
    tok = AutoTokenizer.from_pretrained(target)
    data = tiny_writer.build_data()
    sets = {name: [ids for ids, _ in tiny_writer.prompts(tok, data, name, args.prompts)] for name in args.sets}
    stop = [tok.eos_token_id]
    drafters = [(f"{name}#{i}", Path(d).resolve()) for i, (name, d) in enumerate(named)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    req = mtp_request(target, sets, stop, args.k, args.max_new, drafters)
    result = run_driver("vllm", engine_python(), req, args.out.parent / "bench_mtp_engine", 7200)
    lookup = {}
    for k in args.k:  # one driver run each (mtp_request says why)
        req = mtp_request(target, sets, stop, [k], args.max_new, ngram=True)
        lookup |= summarise(run_driver("vllm", engine_python(), req, args.out.parent / f"bench_ngram_k{k}", 900),
                            [k], "ngram")
    figures = {OWN: [summarise(result, args.k)], "ngram lookup": [lookup]}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # once, for every module
    inproc = {OWN: {"": [in_process(model, module_of(target, None), sets, stop, args.k, args.max_new)]}}
    for label, d in drafters:
        name = label.split("#")[0]
        figures.setdefault(name, []).append(summarise(result, args.k, label))
        record = json.loads((d / "fledge_training.json").read_text()) if (d / "fledge_training.json").exists() else {}
        if record.get("spec", {}).get("algorithm") == "mtp":
            chains = {"": False} if record["spec"].get("norm_output", True) else {"": False, "pre-norm": True}
            for chain, pre in chains.items():
                inproc.setdefault(name, {}).setdefault(chain, []).append(
                    in_process(model, module_of(target, d, pre), sets, stop, args.k, args.max_new))
    plain = result["engines"]["plain"]["sets"]
    distinct = {s: sum(distinct_ngram_ratio(o) for o in plain[s]["outputs"]) / len(plain[s]["outputs"]) for s in sets}
    when = datetime.date.today().isoformat()
    report = {"target": str(target), "machine": machine(), "engine_device": result["device"], "date": when,
              "vllm": result["vllm_version"], "prompts": args.prompts, "max_new_tokens": args.max_new,
              "drafters": {label: str(d) for label, d in drafters}, "distinct_3": distinct,
              "figures": figures, "in_process": inproc}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{target}: vLLM {result['vllm_version']}, float32, greedy, batch of the whole set, {args.prompts} prompts "
          f"x {args.max_new} tokens per set; {machine()}; {when}")
    for s in args.sets:
        print(f"\n{s} (plain output's distinct-3-gram ratio {distinct[s]:.2f}):\n")
        print(table(figures, inproc, s, args.k))
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
