"""DSpark's serving layout: the directory vLLM 0.32's ``Qwen3DSparkForCausalLM`` loads (``method="dspark"``), and
everything serving does with it (the functions of serving/layouts.py's ``Layout``, registered there as ``dspark``).
A DSpark drafter is a DFlash one (models/dspark.py), so this layout is DFlash's (serving/dflash_layout.py) with
vLLM's DSpark keys; the tensors, the spec, the loading and most of the lint are DFlash's functions.

What vLLM reads (vllm/model_executor/models/qwen3_dspark.py, the runtime v1/worker/gpu/spec_decode/dspark/, the
speculators conversion transformers_utils/configs/speculators/algos.py ``update_dspark``, config/speculative.py), and
so what the export writes and the linter checks:

- ``architectures: ["Qwen3DSparkModel"]`` (DFlash's Qwen3 backbone plus the DSpark heads), ``model_type: "qwen3"``,
  every layer ``full_attention`` and no sliding window, as DFlash's.
- top-level keys, as vLLM's own DSpark configs hold them: ``target_layer_ids`` (0-based layer outputs, boundary ids
  - 1, as DFlash's), ``mask_token_id``, ``block_size``. vLLM reads the layers from ``eagle_aux_hidden_state_layer_ids``,
  then ``dflash_config.target_layer_ids``, ``dspark_target_layer_ids`` and ``target_layer_ids``, and the mask from
  ``dflash_config.mask_token_id``, ``mask_token_id`` and ``dspark_noise_token_id``, in that order: the export writes
  only the last of each, and the linter reads them in vLLM's order.
- ``sample_from_anchor: true``: the anchor's slot drafts, a block of ``block_size`` queries drafts ``block_size``
  tokens (false: vLLM's 1 + N fill-in layout, which this drafter was not trained on).
- ``num_speculative_tokens`` must be ``block_size``: vLLM defaults to it, but drafts whatever it is asked for, and a
  block of another length is not the one trained (vLLM's own tracker: a block-5 DSpark drafter served with k=7 fell
  from AL 2.74 to 1.31). ``fledge lint --num-speculative-tokens K`` checks a serving command's K.
- ``markov_rank`` (the head's width; the tensors ``markov_head.markov_w1.weight`` and ``markov_head.markov_w2.weight``,
  both ``[V, r]``) and ``markov_head_type: "vanilla"`` (vLLM's Qwen3 DSpark runs the vanilla head whatever it says);
  ``enable_confidence_head: false`` (Fledge trains none; vLLM drafts the same tokens without it).
- ``max_position_embeddings`` sizes the block's RoPE cache: the target's, as trained.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from fledge.models.dspark import DSparkSpec
from fledge.serving import dflash_layout
from fledge.serving.dflash_layout import Reading, load, serving_tensors  # noqa: F401 (DSpark's are DFlash's)
from fledge.serving.export_reading import Finding, read_export, vocab_findings

ARCHITECTURE = "Qwen3DSparkModel"
NAME = "DSpark"


def owns(config: Mapping) -> bool:
    """Whether an exported config.json is a DSpark drafter's (an architecture vLLM maps to a DSpark model)."""
    return any("DSpark" in a for a in config.get("architectures") or [])


def build_config(layer: dict, spec: Any, aux_layer_ids: list[int], target_hidden_size: int,
                 target_num_layers: int) -> dict:
    """config.json of a DSpark drafter: DFlash's (dflash_layout.build_config), its ``dflash_config`` keys at the top
    level, and DSpark's own."""
    cfg = dflash_layout.build_config(layer, spec, aux_layer_ids, target_hidden_size, target_num_layers)
    block = cfg.pop("dflash_config")
    return {**cfg, "architectures": [ARCHITECTURE], "target_layer_ids": block["target_layer_ids"],
            "mask_token_id": block["mask_token_id"], "sample_from_anchor": True, "markov_rank": int(spec.markov_rank),
            "markov_head_type": "vanilla", "enable_confidence_head": False}


def reading(config: Mapping) -> Reading:
    """The mask token, target layers and block vLLM reads from a DSpark config.json, first key found first."""
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    mask = [("dflash_config.mask_token_id", dflash.get("mask_token_id")),
            ("mask_token_id", config.get("mask_token_id")),
            ("dspark_noise_token_id", config.get("dspark_noise_token_id"))]
    layers = [("dflash_config.target_layer_ids", dflash.get("target_layer_ids")),
              ("dspark_target_layer_ids", config.get("dspark_target_layer_ids")),
              ("target_layer_ids", config.get("target_layer_ids"))]
    blocks = [("block_size", config.get("block_size")), ("dspark_block_size", config.get("dspark_block_size"))]
    mask_key, mask_id = next(((k, v) for k, v in mask if v is not None), mask[1])
    layers_key, ids = next(((k, v) for k, v in layers if v), layers[-1])
    block_key, block = next(((k, v) for k, v in blocks if v is not None), blocks[0])
    return Reading(mask_id, mask_key, ids, layers_key, block, block_key)


def spec_from_config(config: Mapping, target_num_hidden_layers: int | None = None) -> DSparkSpec:
    """The DSparkSpec a DSpark config.json describes, read as vLLM builds it (a public DSpark checkpoint too)."""
    read = reading(config)
    for value, key, what in ((read.layer_ids, read.layers_key, "the 0-based target layers whose outputs the drafter "
                              "was trained on"), (read.mask_token_id, read.mask_key, "the id its blocks were filled "
                              "with"), (config.get("markov_rank"), "markov_rank", "the Markov head's rank")):
        if value is None or value == []:
            raise ValueError(f"config.json has no {key}: add {what}")
    view = {**config, "dflash_config": {"mask_token_id": read.mask_token_id, "target_layer_ids": read.layer_ids,
                                        "block_size": read.block_size or 8}}
    spec = dflash_layout.spec_from_config(view, target_num_hidden_layers)
    own = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return DSparkSpec(**own, markov_rank=int(config["markov_rank"]))


def expected_tensors(config: Mapping) -> dict[str, tuple[int, ...]]:
    """{name: shape} a DSpark config.json implies (all bf16): DFlash's, the Markov head's, and the confidence head's
    (optional: vLLM reads it for adaptive verification only)."""
    read = reading(config)
    out = dflash_layout.expected_tensors({**config, "dflash_config": {"target_layer_ids": read.layer_ids}})
    V, H, r = int(config["vocab_size"]), int(config["hidden_size"]), int(config["markov_rank"])
    Vd = int(config.get("draft_vocab_size") or V)
    out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (Vd, r),
                "optional:confidence_head.proj.weight": (1, H + r * bool(config.get("confidence_head_with_markov"))),
                "optional:confidence_head.proj.bias": (1,)})
    return out


def lint(d, config: Mapping, target_layers: int | None, record: dict | None) -> list[Finding]:
    """The DSpark-specific findings on the export in ``d`` (serving/lint.py adds the checks against the target and
    the training record that every layout gets): DFlash's block findings as vLLM reads a DSpark config, DSpark's own
    keys, and the tensors."""
    headers, trained, out = read_export(d, record)
    out += findings(config, headers, target_layers, trained)
    out += vocab_findings(d, config, headers)
    return out + dflash_layout.no_record(record)


def findings(config: Mapping, headers: Mapping[str, tuple[list[int], str]] | None, target_layers: int | None,
             trained: DSparkSpec | None) -> list[Finding]:
    """What would make vLLM serve this DSpark export otherwise than it was trained (``trained``: the training
    record's spec), or refuse it."""
    out: list[Finding] = []
    add = lambda *f: out.append(f)  # noqa: E731
    archs = config.get("architectures") or []
    if ARCHITECTURE not in archs:
        add("error", "architecture", f"architectures={archs}: vLLM builds its Qwen3 DSpark drafter from "
            f"{ARCHITECTURE}", f'set "architectures": ["{ARCHITECTURE}"]')
    out += dflash_layout.block_findings(config, reading(config), target_layers, trained, NAME, anchor_drafts=True)
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    if config.get("sample_from_anchor", True) is not True or dflash.get("sample_from_anchor"):
        add("error", "dspark-sample-from-anchor", f"sample_from_anchor={config.get('sample_from_anchor')!r}"
            f"{' and dflash_config.sample_from_anchor is set' if dflash.get('sample_from_anchor') else ''}: vLLM "
            "would run the 1 + N fill-in block (or refuse a dflash_config one), but the drafter was trained with its "
            "anchor drafting", 'write "sample_from_anchor": true at the top level only')
    rank = config.get("markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        add("error", "dspark-markov", f"markov_rank={rank!r}: vLLM builds the Markov head from it",
            "write the rank the drafter was trained with (its training record's spec.markov_rank)")
    elif trained is not None and rank != getattr(trained, "markov_rank", rank):
        add("error", "dspark-markov", f"markov_rank={rank} but the drafter was trained with {trained.markov_rank}",
            f"write markov_rank={trained.markov_rank}")
    if config.get("markov_head_type", "vanilla") != "vanilla":
        add("error", "dspark-markov", f"markov_head_type={config.get('markov_head_type')!r}: vLLM's Qwen3 DSpark runs "
            "the vanilla head whatever this says, and Fledge trains only that one", 'write "markov_head_type": '
            '"vanilla", or serve a gated / rnn head with the engine it was trained for')
    if headers is not None:
        out += dflash_layout.tensor_findings(expected_tensors, config, headers)
    return out


def block_size(config: Mapping) -> int | None:
    """The block the export was trained on (``block_size``, else ``dspark_block_size``); None if unwritten."""
    block = reading(config).block_size
    return int(block) if block else None


def speculative_config(config: Mapping, model: str, k: int) -> dict:
    """vLLM's ``speculative_config`` for the export whose config.json is ``config``, at ``model``: its dspark method,
    with ``num_speculative_tokens`` = the trained block whatever ``k`` asks (a DSpark block drafts exactly its length;
    `fledge lint --num-speculative-tokens` and the config's rules refuse another k)."""
    block = block_size(config)
    return {"method": "dspark", "model": str(model), "num_speculative_tokens": block or int(k)}


# Where the DSpark objective's defaults come from (train/objectives/dspark.py, conf/drafter/dspark.yaml).
SOURCES = ("DSpark as speculators 0.9.0 trains it (models/dspark) and vLLM 0.32 serves it (method dspark): DFlash's "
           "block drafter whose anchor slot drafts too (sample_from_anchor), with a rank-256 Markov bias on each "
           "slot's logits from the token before it (teacher-forced in training, sampled left to right when drafting); "
           "slot j weighted exp(-j/gamma) with gamma 4; soft cross-entropy against the target's distribution.")


def card(config: Mapping, record: dict, repo_id: str, served: dict) -> tuple[list[str], list[str]]:
    """The card's own sections for a DSpark export (serving/card.py adds the measured ones) and its tags; ``served``
    is the speculative_config its command carries (serving_config.py's ``vllm_speculative_config``)."""
    target = (record.get("target") or {}).get("name_or_path") or "<target>"
    read = reading(config)
    block = block_size(config) or int(served["num_speculative_tokens"])
    parts = [
        f"# {repo_id.split('/')[-1]}\n",
        f"A DSpark block drafter for **{target}**, trained with Fledge: one forward proposes a whole block, whose "
        "tokens a small Markov head then picks in order; the target verifies them, so outputs are the target's own.\n",
        "## Drafter\n",
        f"- format: vLLM's DSpark layout ({', '.join(config.get('architectures') or [])}, "
        f"{config.get('num_hidden_layers')} Qwen3 layer(s), Markov rank {config.get('markov_rank')})",
        f"- block size: {block} (serve exactly {block} speculative tokens: `num_speculative_tokens` = the block)",
        f"- target layers (0-based, `target_layer_ids`): `{read.layer_ids}`",
        f"- mask token id: {read.mask_token_id}; the target's embedding and lm_head are shared, not shipped",
        f"- trained steps: {record.get('step')}",
        f"- objective: {SOURCES}\n",
        "## Serving\n",
        f"```bash\nvllm serve {target} --speculative-config '{json.dumps(served)}'\n```\n",
        "vLLM 0.32 runs DSpark in its V2 model runner on a GPU only (its CPU build refuses the method). SGLang: not "
        "given.\n",
    ]
    return parts, ["speculative-decoding", "dspark", "drafter"]
