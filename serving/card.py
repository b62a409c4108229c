"""The model card of an exported drafter: what it is, how to serve it, and what a run measured about it.

The card is built from content, never from a run directory: the pipeline's publish stage (and ``fledge push
--run-dir``) gathers what the run measured of this very export into a :class:`Measured` (pipeline/publish.py)
and hands it here. Its engine section is the AL table vLLM measured (eval.engine=vllm) with the exact vLLM
call that reproduces it; SGLang is marked as not measured here (its command is the dialect's,
serving/dialects.py, given only for an export SGLang reads as trained).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fledge.atomic import read_json
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.serving.dialects import dialect_of, serving_commands
from fledge.serving.layouts import layout_of
from fledge.serving.serving_config import layer_config, parallel_drafting, vllm_speculative_config


@dataclass
class Measured:
    """What a run measured about the export a card is for: the eval stage's summary (``outputs``) and plots,
    the engine section of its report (``engine``) and the request the engine ran (``engine_request``), and
    the run's config as YAML text (``run_config``). Empty: nothing measured (the card says so)."""

    outputs: dict | None = None
    plots: list[Path] = field(default_factory=list)
    engine: dict | None = None
    engine_request: dict | None = None
    run_config: str = ""


def _f(x, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def engine_section(e: dict | None, request: dict | None, repo_or_dir: str, served: dict) -> str:
    """Markdown for the card from the eval report's engine section ``e`` and the engine's ``request``, or ""
    when the eval did not serve the export with an engine; ``served``: the card's speculative_config, for a
    request that does not hold the drafter's."""
    if not e:
        return ""
    request = request or {}
    k = e["k"]
    alone = all(s.get("in_process_al") is None for s in e["sets"].values())  # eval.in_process=false
    lines = [f"Measured by serving this drafter with **{e['engine']} {e['version']}** on {e['device']} "
             f"(dtype {e['dtype']}, greedy, k={k}); AL = 1 + accepted / drafts from vLLM's own spec-decode "
             "counters, " + ("the prompts measured by the engine alone (no in-process AL)." if alone else
                             "next to Fledge's in-process measurement on the same prompts."), "",
             "| set | prompts | engine AL | in-process AL | vLLM ngram AL | accepted per position (engine) | "
             "tokens/s plain -> drafter |", "|---|---|---|---|---|---|---|"]
    for name, s in e["sets"].items():
        t = s["tokens_per_s"]
        lines.append(f"| {name} | {s['prompts']} | {_f(s['drafter']['al'])} | {_f(s['in_process_al'])} | "
                     f"{_f(s['lookup']['al'])} | {' '.join(_f(a) for a in s['drafter']['accept_at'])} | "
                     f"{_f(t['plain'], 1)} -> {_f(t['drafter'], 1)} |")
    lines += ["", "Reproduce (the prompts are the token ids in the run's `eval/engine/request.json`):", "",
              "```python", reproduce_snippet(request, repo_or_dir, served), "```"]
    return "\n".join(lines) + "\n"


def reproduced_config(request: dict, repo_or_dir: str, served: dict) -> dict:
    """The speculative_config the engine eval sent vLLM for the drafter (``request``'s), with this card's drafter
    location: every key as it was (parallel_drafting, a CPU attention backend); ``served`` when the request
    holds none."""
    sent = [e.get("speculative_config") for e in request.get("engines") or [] if e.get("name") == "drafter"]
    return {**sent[0], "model": repo_or_dir} if sent and sent[0] else dict(served)


def reproduce_snippet(request: dict, repo_or_dir: str, served: dict) -> str:
    """The vLLM calls the engine eval made, with this card's drafter location (:func:`reproduced_config`)."""
    spec = reproduced_config(request, repo_or_dir, served)
    env = "".join(f"os.environ[{key!r}] = {val!r}{'  # GiB' if key == 'VLLM_CPU_KVCACHE_SPACE' else ''}\n"
                  for key, val in (request.get("env") or {}).items())
    # the target as the eval's driver loads it (serving/vllm_side/eval_driver.py): its revision, its code, and the
    # attention backend it needed on this device
    target = "".join(f"{key}={request[key]!r}, " for key in ("revision", "trust_remote_code", "attention_backend")
                     if request.get(key))
    return (f"import json, os\n{env}from vllm import LLM, SamplingParams\n\n"
            f"if __name__ == \"__main__\":  # vLLM starts its engine core with spawn\n"
            f"    llm = LLM(model={request.get('target', '<target>')!r}, dtype={request.get('dtype', 'auto')!r}, "
            f"max_model_len={request.get('max_model_len', 4096)}, seed={request.get('seed', 0)},\n"
            f"              {target}enforce_eager=True, disable_log_stats=False, "
            f"speculative_config={json.dumps(spec)})\n"
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
            "command only for an export SGLang reads as trained (export.format=sglang, a chain drafter): SGLang "
            "adds 1 to every explicit aux-layer id, so it would feed an export.format=hf drafter other layers than "
            "in training, and it has no parallel drafting for a P-EAGLE drafter.")


# ------------------------------------------------------------------------------------------ the card
def _al_table(outputs: dict) -> str:
    """A markdown table of the measured acceptance lengths: one row per eval set when the eval stage
    reports ``{"sets": {name: {...metrics}}}``, else one row of its scalar outputs."""
    sets = outputs.get("sets") if isinstance(outputs.get("sets"), dict) else {"all": outputs}
    rows = {name: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for name, m in sets.items() if isinstance(m, dict)}
    cols = sorted({k for m in rows.values() for k in m})
    if not cols:
        return ""
    lines = ["| set | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, m in rows.items():
        cells = [f"{m[c]:.3f}" if isinstance(m.get(c), float) else str(m.get(c, "")) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_model_card(drafter_dir: str | Path, repo_id: str, measured: Measured | None = None,
                     speculative_tokens: int = 5, plot_prefix: str = "eval"):
    """(a ``huggingface_hub.ModelCard``, the plots it shows) for an exported drafter: target, data, training
    config, the eval stage's AL table and plots when ``measured`` has them, and the serving commands of its
    dialect."""

    measured = measured or Measured()
    d = Path(drafter_dir)
    config = read_json(d / "config.json") or {}
    record = DrafterCheckpoint.read_record(d) or {}
    run_cfg = measured.run_config.strip()
    datasets = _datasets(run_cfg)
    layout = layout_of(config)
    served = vllm_speculative_config(config, repo_id, speculative_tokens)  # the eval stage's, from this repo
    if layout is not None:  # not EAGLE's: its own sections (serving/layouts.py)
        parts, tags = layout.card(config, record, repo_id, served)
        target = (record.get("target") or {}).get("name_or_path") or "<target>"
        return _with_measured(parts, _card_data(target, tags, datasets), record, measured, repo_id, run_cfg,
                              datasets, served, plot_prefix)
    c = layer_config(config)
    dialect = dialect_of(config)
    target = (record.get("target") or {}).get("name_or_path") or c.get("target_name") or "<target>"
    flavour = "EAGLE-3.1" if c.get("fc_norm") or c.get("norm_output") else "EAGLE-3"
    parallel = parallel_drafting(config)
    tag = "p-eagle" if parallel else flavour.lower()
    flavour = f"P-EAGLE ({flavour} with parallel drafting)" if parallel else flavour
    card_data = _card_data(target, ["speculative-decoding", "eagle3", "drafter", tag], datasets)
    parts = [
        f"# {repo_id.split('/')[-1]}\n",
        f"An {flavour} speculative-decoding drafter for **{target}**, trained with Fledge. It proposes "
        "tokens that the target verifies, so outputs are the target's own.\n",
        "## Drafter\n",
        f"- format: `{dialect.name}` ({', '.join(config.get('architectures') or [])})",
        f"- aux layers (boundary convention): `{c.get('aux_layer_ids')}`",
        f"- flags: fc_norm={bool(c.get('fc_norm'))}, norm_output={bool(c.get('norm_output'))}",
        f"- draft vocab: {c.get('draft_vocab_size')} of {c.get('vocab_size')} target tokens",
        f"- trained steps: {record.get('step')}\n",
        "## Serving\n",
        serving_commands(dialect, served, target) + "\n",
        *(["SGLang builds EAGLE-3.1's `fc_norm` and `norm_output` only in releases that added EAGLE-3.1 drafters; "
           "an older one loads this drafter as EAGLE-3 without a word (it skips the `fc_norm` weights and feeds "
           "back the un-normed state): serve it with an SGLang whose `llama_eagle3` reads both flags.\n"]
          if "SGLang" in dialect.engines and not parallel and (c.get("fc_norm") or c.get("norm_output")) else []),
        *(["vLLM drafts all k tokens of this drafter in one forward because the command says "
           "`\"parallel_drafting\": true`; without it vLLM runs it as a chain drafter, without a word, at a lower "
           "acceptance. SGLang has no parallel drafting for EAGLE drafters.\n"] if parallel else []),
    ]
    return _with_measured(parts, card_data, record, measured, repo_id, run_cfg, datasets, served, plot_prefix)


def _card_data(target: str, tags: list[str], datasets: list[str]):
    from huggingface_hub import ModelCardData

    return ModelCardData(base_model=target if "/" in target and not Path(target).exists() else None,
                         library_name="fledge", tags=tags, datasets=datasets or None, pipeline_tag="text-generation")


def _with_measured(parts: list[str], card_data, record: dict, measured: Measured, repo_id: str, run_cfg: str,
                   datasets: list[str], served: dict, plot_prefix: str = "eval"):
    """The card's measured sections after its own ``parts``: the AL table, the engine's, plots, metrics, data."""
    from huggingface_hub import ModelCard

    outputs, plots = measured.outputs, list(measured.plots)
    parts.append("## Measured acceptance\n")
    table = _al_table(outputs) if outputs else ""
    parts.append(table + "\n" if table else "No eval-stage results were found for this export.\n")
    # eval.engine=vllm: the engine's table and the call that reproduces it
    engine = engine_section(measured.engine, measured.engine_request, repo_id, served) if outputs else ""
    parts += ["## Measured by the serving engine\n", engine, sglang_note() + "\n"] if engine else []
    parts += [f"![{p.stem}]({plot_prefix}/{p.name})" for p in plots]
    if record.get("metrics"):
        parts += ["\n## Training metrics (held-out, offline)\n",
                  "\n".join(f"- {k}: {v}" for k, v in sorted(record["metrics"].items()))]
    if datasets:
        parts += ["\n## Data\n", "\n".join(f"- {x}" for x in datasets)]
    if run_cfg:
        parts += ["\n## Training configuration\n", f"```yaml\n{run_cfg}\n```"]
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(parts) + "\n"
    return ModelCard(content), plots


def _datasets(run_config: str) -> list[str]:
    """Data source paths from the run's config (YAML text; hub ids become card metadata)."""
    if not run_config:
        return []
    import yaml  # only for a card with a run's config

    cfg = yaml.safe_load(run_config) or {}
    srcs = (cfg.get("data") or {}).get("sources") or []
    return [s["path"] for s in srcs if isinstance(s, dict) and s.get("path")]
