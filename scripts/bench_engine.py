#!/usr/bin/env python
"""Engine AL vs in-process AL, and vLLM's decode tokens/s with and without the drafter, at k = 1..7 in one run.

    .venv/bin/python scripts/bench_engine.py recipe=tiny run.output_root=outputs [the run's other overrides]
        [--ks 1 2 3 4 5 6 7] [--prompts 8] [--max-new 64] [--batch-size 1] [--out outputs/bench_engine.json]

Reads a finished run (its prepare and export stages), named by the run's own overrides: on the CPU machines
`recipe=tiny`; on a GPU node a Hub target's run (`recipe=llama3` or `recipe=qwen3`, with the engine python of
that node in eval.engine_python or FLEDGE_ENGINE_PYTHON). On the run's held-out prompts (the ``default``
set, rendered as the eval stage renders them) it measures Fledge's in-process AL at each k (chain drafting,
greedy, the eval stage's harness, on CUDA when there is one), then serves the export with real vLLM in one
driver process: plain greedy (the baseline of the same run), then EAGLE-3 at each k. Prompts go one at a
time by default (``--batch-size 1``: the latency regime speculative decoding is for); tokens/s excludes
engine start-up and a warm-up request and is labelled with the engine's device. Every speculative output
is compared with the plain one token for token. Prints a markdown table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

from fledge.run_layout import RunLayout
from fledge.stage_inputs import EvalInputs


def in_process_al(inputs: EvalInputs, run: RunLayout, drafter_dir: Path, ks: list[int], max_new: int,
                  device: torch.device):
    """(prompts, stop ids, max positions, {k: AL}, {k: greedy-equal count}) from Fledge's harness."""
    from fledge.data.prepare.build import load_tokenizer
    from fledge.data.prepare.chat import ChatRenderer, eot_ids_from_target
    from fledge.evaluation.acceptance import acceptance_stats
    from fledge.evaluation.evaluate import load_eval_models
    from fledge.evaluation.prompt_sets import build_prompt_sets
    from fledge.evaluation.speculative import DrafterProposer, TargetRunner, greedy_decode, speculative_decode
    from fledge.serving.export import spec_from_export

    target = inputs.target
    renderer = ChatRenderer(load_tokenizer(target, inputs.chat_template),
                            extra_eot_ids=eot_ids_from_target(target.name_or_path, target.revision))
    eos = sorted(renderer.eot_ids)
    frozen, drafter = load_eval_models(target, drafter_dir, device, spec_from_export(drafter_dir, serving=True))
    model = frozen.model
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    prompts = build_prompt_sets(inputs.eval, renderer, run.prepare, max_pos - max_new - max(ks) - 2)["default"]
    runner, plain, prop = TargetRunner(model, drafter.spec.aux_layer_ids), TargetRunner(model), DrafterProposer(drafter)
    with torch.inference_mode():
        refs = [greedy_decode(plain, p, max_new, eos)[0] for p in prompts]
        als, same = {}, {}
        for k in ks:
            res = [speculative_decode(runner, prop, p, k, max_new, eos) for p in prompts]
            als[k] = acceptance_stats(res, k)["al"]
            same[k] = sum(r.tokens == ref for r, ref in zip(res, refs))
            print(f"in-process k={k}: AL {als[k]:.3f}", file=sys.stderr, flush=True)
    del runner, plain, prop, drafter, model, frozen
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to vLLM
    return prompts, eos, max_pos, als, same


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="the run's config overrides (recipe=tiny run.output_root=...)")
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 8)))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per vLLM generate call (0: all at once)")
    ap.add_argument("--out", default="outputs/bench_engine.json")
    args = ap.parse_args(argv)

    from fledge.conf.compose import compose
    from fledge.evaluation.engine_eval import build_request
    from fledge.pipeline.stages import eval_inputs
    from fledge.serving.engine import acceptance, check_engine, run_driver, speculative_config

    try:
        cfg = compose(args.overrides)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        python = check_engine("vllm", device.type, cfg.eval.engine_python)
        run = RunLayout.of(cfg.run)
        drafter_dir = run.export.drafter
        if not (drafter_dir / "config.json").exists():
            raise ValueError(f"{drafter_dir}: no export; run the pipeline with these overrides first")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    inputs = eval_inputs(cfg)  # what the eval stage reads of the run's config, on the default set at these sizes
    inputs = dataclasses.replace(inputs, eval=dataclasses.replace(
        inputs.eval, sets=["default"], num_prompts=args.prompts, max_new_tokens=args.max_new,
        engine_batch_size=args.batch_size))
    prompts, eos, max_pos, inproc, inproc_same = in_process_al(inputs, run, drafter_dir, args.ks, args.max_new,
                                                               device)

    req = build_request(inputs, {"default": prompts}, drafter_dir, eos, max_pos, device.type)
    req["gpu_memory_utilization"] = 0.85  # the harness's target is gone: vLLM may take the GPU
    req["engines"] = [{"name": "plain"}] + [
        {"name": f"k{k}", "speculative_config": speculative_config("eagle3", k, drafter_dir)} for k in args.ks]
    t0 = time.perf_counter()
    res = run_driver("vllm", python, req, run.root / "bench_engine", 3600)
    engine_s = time.perf_counter() - t0
    plain = res["engines"]["plain"]["sets"]["default"]
    plain_tps = plain["tokens"] / plain["wall_s"]
    rows = []
    for k in args.ks:
        s = res["engines"][f"k{k}"]["sets"]["default"]
        a = acceptance(s["counters"], k)
        same = sum(x == y for x, y in zip(s["outputs"], plain["outputs"]))
        rows.append({"k": k, "in_process_al": inproc[k], "engine_al": a["al"], "gap": a["al"] - inproc[k],
                     "accept_at": a["accept_at"], "tokens_per_s": s["tokens"] / s["wall_s"],
                     "speedup": s["tokens"] / s["wall_s"] / plain_tps,
                     "engine_greedy_equal": f"{same}/{len(s['outputs'])}",
                     "in_process_greedy_equal": f"{inproc_same[k]}/{len(prompts)}"})
    out = {"device": res["device"], "vllm": res["vllm_version"], "target": cfg.target.name_or_path,
           "dtype": req["dtype"], "prompts": len(prompts), "max_new_tokens": args.max_new,
           "batch_size": args.batch_size or "all", "plain_tokens_per_s": plain_tps, "engine_wall_s": engine_s,
           "load_s": {n: e["load_s"] for n, e in res["engines"].items()}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{res['device']}, vLLM {res['vllm_version']}, {cfg.target.name_or_path} in {req['dtype']}, "
          f"{out['prompts']} prompts x {args.max_new} tokens, batch {out['batch_size']}; plain decode "
          f"{plain_tps:.1f} tokens/s (the baseline, same run); engine run {engine_s:.0f} s")
    print("| k | in-process AL | engine AL | gap | engine tokens/s | speed-up vs plain | greedy equal (engine) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['in_process_al']:.2f} | {r['engine_al']:.2f} | {r['gap']:+.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['engine_greedy_equal']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
