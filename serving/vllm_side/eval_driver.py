"""The vLLM side of the engine eval: runs ONLY under the serving engine's python (.engine/venv, or a GPU
node's vLLM environment), never inside Fledge's process, and imports nothing of Fledge.

    <engine python> -I engine_vllm_driver.py REQUEST.json RESULT.json

Fledge (fledge.serving.engine) writes the request and reads the result; both are plain JSON (no
pickle crosses the boundary). The request names the target, the engine settings and a list of engine
configurations (``plain``: no drafter; others carry a vLLM ``speculative_config``), and the prompt sets as
token ids. For every configuration the driver builds one ``vllm.LLM``, generates greedily on each set and
records, per set: the output token ids of every prompt, wall time and output tokens, and the deltas of
vLLM's own spec-decode counters over that set (drafts, drafted and accepted tokens, accepted per position).
With ``logprobs`` it also returns, per generated position, the gap between the top-2 log-probabilities
(the parent uses the plain run's gaps to tell a numerical tie from a real greedy divergence). With
``sampled_temperature`` a configuration also samples each set at that temperature, untimed, and returns that
pass's counter deltas apart (``sampled``): the engine's acceptance under its own rejection sampling.

``-I`` keeps the script's own folder (fledge/models, with modules named like PyPI packages) off sys.path.
vLLM starts its engine core with spawn, which re-imports this file: hence the ``__main__`` guard.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
import traceback

COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def device_label() -> str:
    """What the engine ran on, for labelling tokens/s: the GPU's name, or the CPU model and usable cores."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA)"
    model, amx = platform.processor() or "CPU", False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model in ("CPU", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    amx = amx or "amx_tile" in line.split()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {model}{' with AMX' if amx else ''}, {cores} cores"


def counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters, summed over label sets (one engine here)."""
    out = {k: 0 for k in COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        for key, name in COUNTERS.items():
            if m.name == name:
                out[key] += int(m.value)
        if m.name == PER_POS:
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * len(vals), vals)] if per_pos else vals
    out["accepted_per_pos"] = per_pos
    return out


def delta(after: dict, before: dict) -> dict:
    """Counters accumulated between two snapshots."""
    out = {k: after[k] - before[k] for k in COUNTERS}
    pa, pb = after["accepted_per_pos"], before["accepted_per_pos"]
    pb = pb + [0] * (len(pa) - len(pb))
    out["accepted_per_pos"] = [a - b for a, b in zip(pa, pb)]
    return out


def top2_gaps(logprobs) -> list[float]:
    """Per generated position, logprob(top-1) - logprob(top-2) (equal to the logit gap); inf without a 2nd."""
    gaps = []
    for pos in logprobs or []:
        vals = sorted((lp.logprob for lp in pos.values()), reverse=True)
        gaps.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return gaps


def run_engine(req: dict, conf: dict) -> dict:
    """One vLLM configuration over every prompt set."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=req["target"], dtype=req.get("dtype", "auto"), max_model_len=req["max_model_len"],
                  seed=req.get("seed", 0), enforce_eager=req.get("enforce_eager", True),
                  trust_remote_code=req.get("trust_remote_code", False), disable_log_stats=False,
                  gpu_memory_utilization=req.get("gpu_memory_utilization", 0.85))
    if req.get("revision"):
        kwargs["revision"] = req["revision"]
    if req.get("attention_backend"):  # e.g. CPU_MLA for an MLA target on CPU (evaluation/engine_eval.py)
        kwargs["attention_backend"] = req["attention_backend"]
    if conf.get("speculative_config"):
        kwargs["speculative_config"] = conf["speculative_config"]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    logprobs = conf.get("logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"], stop_token_ids=req["stop_token_ids"],
                            detokenize=False, seed=req.get("seed", 0))
    lp_params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                               stop_token_ids=req["stop_token_ids"], detokenize=False, logprobs=logprobs,
                               seed=req.get("seed", 0))
    result = {"load_s": load_s, "sets": {}}
    bs = int(req.get("batch_size") or 0)
    first = next(iter(req["sets"].values()))[:1]
    # One short untimed request first: the first generate call pays one-off set-up that is not decoding.
    llm.generate([{"prompt_token_ids": p} for p in first], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    for name, prompts in req["sets"].items():
        outs, wall = [], 0.0
        before = counters(llm)
        for i in range(0, len(prompts), bs or max(1, len(prompts))):
            chunk = [{"prompt_token_ids": p} for p in prompts[i:i + (bs or len(prompts))]]
            t0 = time.perf_counter()
            got = llm.generate(chunk, params, use_tqdm=False)
            wall += time.perf_counter() - t0
            outs += [list(o.outputs[0].token_ids) for o in got]
        result["sets"][name] = {"outputs": outs, "wall_s": wall, "tokens": sum(map(len, outs)),
                                "counters": delta(counters(llm), before)}
        if conf.get("sampled_temperature"):  # untimed: vLLM's rejection sampling, counted apart from greedy
            before = counters(llm)
            sp = SamplingParams(temperature=float(conf["sampled_temperature"]), max_tokens=req["max_new_tokens"],
                                stop_token_ids=req["stop_token_ids"], detokenize=False, seed=req.get("seed", 0))
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            result["sets"][name]["sampled"] = {"temperature": float(conf["sampled_temperature"]),
                                               "tokens": sum(len(o.outputs[0].token_ids) for o in got),
                                               "counters": delta(counters(llm), before)}
        if logprobs:  # an untimed second pass (log-probs cost time the baseline should not pay)
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], lp_params, use_tqdm=False)
            result["sets"][name]["top2_gaps"] = [top2_gaps(o.outputs[0].logprobs) for o in got]
            result["sets"][name]["logprob_pass_equal"] = [list(o.outputs[0].token_ids) for o in got] == outs
        print(f"engine {conf['name']} {name}: {result['sets'][name]['tokens']} tokens in {wall:.1f} s",
              file=sys.stderr, flush=True)
    del llm  # shut the engine core down before the next configuration starts one
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: engine_vllm_driver.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        req = json.load(f)
    for key, value in (req.get("env") or {}).items():  # before vLLM is imported: it reads them at import
        os.environ[key] = str(value)
    import vllm

    out = {"vllm_version": vllm.__version__, "device": device_label(), "engines": {}}
    try:
        for conf in req["engines"]:
            out["engines"][conf["name"]] = run_engine(req, conf)
    except Exception as e:  # noqa: BLE001 - reported to Fledge as data, with which configuration failed
        out["error"] = {"engine": conf["name"], "type": type(e).__name__, "message": str(e)[-4000:],
                        "traceback": traceback.format_exc()[-8000:]}
    tmp = argv[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
