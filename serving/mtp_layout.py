"""The MTP drafter's serving layout: the drafter directory vLLM 0.32 loads with ``method: mtp`` (the functions of
serving/layouts.py's ``Layout``, registered there as ``mtp``).

What vLLM reads (config/speculative.py, model_executor/models/deepseek_mtp.py, v1/spec_decode/llm_base_proposer.py),
and so what the export writes and the linter checks:

- ``speculative_config: {"method": "mtp", "model": <dir>}`` takes the draft from the directory instead of the
  target's own checkpoint. Its config.json is the target's (``model_type: deepseek_v3``, which
  ``SpeculativeConfig.hf_config_override`` rewrites into ``DeepSeekMTPModel``): the decoder layer is built from it
  (an MoE layer past ``first_k_dense_replace``), so every field the layer reads must be the target's; the export
  drops ``quantization_config`` (its tensors are bf16) and ``auto_map``.
- the module is layer ``num_hidden_layers`` of it, ``num_nextn_predict_layers`` of them: a tensor is the module's
  only under ``model.layers.{L}.`` (``get_spec_layer_idx_from_weight_name``); anything at another index is skipped
  without a word, and a config of 0 MTP layers loads none. The export writes ``num_nextn_predict_layers: 1`` (vLLM
  runs the one module for every draft) and ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the decoder
  layer's tensors (models/mtp.py's names, one tensor per expert).
- the embedding and ``shared_head.head`` are always the target's (``_maybe_share_embeddings`` /
  ``_maybe_share_lm_head``: for an MTP draft vLLM replaces both with the target's), so the export leaves them out: a
  copy shipped in the directory is dropped at load, however it was trained.
- drafts after the first read ``shared_head.norm(out)`` of the step before (``DeepSeekMultiTokenPredictorLayer``
  returns (out, shared_head(out)); the proposer feeds the second): a drafter trained with ``norm_output: false``
  is served with another state than it was trained on, which the lint refuses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD
from fledge.models.mtp import DECODERS, MTPModule, checkpoint_tensors, module_state_dict
from fledge.models.mtp_drafter import MtpDrafter, MtpSpec
from fledge.models.weights import load_input_embeddings, load_lm_head_rows, read_tensors, tensor_headers
from fledge.serving.export_reading import Finding, read_export

_DROPPED = ("quantization_config", "auto_map", "_name_or_path", "transformers_version")  # not the bf16 export's
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's: vLLM shares them
# Fields of config.json that do not shape the module (the rest must be the ones it was trained as)
_UNSHAPED = (*_DROPPED, "architectures", "torch_dtype", "dtype", "num_nextn_predict_layers")
SOURCES = "vLLM 0.32 model_executor/models/deepseek_mtp.py, v1/spec_decode/llm_base_proposer.py"
_MODULE_ONLY = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # parts only an MTP layer has
DRAFTER_LAYER = False  # config.json is the target's own: serving/lint.py checks no drafter layer against it


def owns(config: Mapping) -> bool:
    """Whether a config.json is an MTP drafter's: a target's own config of a model type whose MTP module vLLM's
    deepseek_mtp.py serves (an EAGLE drafter's MLA layer is written as ``deepseek_v2``: models/layers/mla.py)."""
    return config.get("model_type") in DECODERS


def build_config(layer: dict, spec: Any, aux_layer_ids: list[int], target_hidden_size: int,
                 target_num_layers: int) -> dict:
    """config.json of an MTP export: the target's own (``spec.target_config``) with one bf16 MTP layer."""
    cfg = {k: v for k, v in spec.target_config.items() if k not in _DROPPED}
    return {**cfg, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "dtype": "bfloat16"}


def serving_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's state_dict (``layers.{L}.*``, models/mtp_drafter.py) -> the module's checkpoint tensors
    (``model.layers.{L}.*``, models/mtp.py's names) in bf16, the target's shared tables left out."""
    (L,) = {name.split(".")[1] for name in state_dict}
    prefix = f"layers.{L}."
    module = {name[len(prefix):]: t for name, t in state_dict.items() if name[len(prefix):] not in _SHARED}
    named = checkpoint_tensors(SimpleNamespace(layer_index=int(L), state_dict=lambda: module))
    return {name: t.to(torch.bfloat16).contiguous() for name, t in named.items()}


def spec_from_config(config: Mapping, target_num_hidden_layers: int | None = None) -> DrafterSpec:
    """The spec vLLM serves from an MTP config.json (a Fledge export, or a target's own directory: its untouched
    module): fed back post-norm, as vLLM 0.32 chains it."""
    return MtpSpec.from_target_config(config, {"algorithm": "mtp", "norm_output": True, "layer": "auto"})


def expected_tensors(config: Mapping) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the MTP layer a config.json describes (the shared tables aside): the module built on the
    meta device, so a full-size config costs nothing."""
    spec = spec_from_config(config)
    with torch.device("meta"):
        V, H = spec.vocab_size, spec.target_hidden_size
        module = MTPModule(spec.module_config(), nn.Embedding(V, H), nn.Linear(H, V, bias=False))
    prefix = f"model.layers.{module.layer_index}."
    return {name: tuple(t.shape) for name, t in checkpoint_tensors(module).items()
            if name[len(prefix):] not in _SHARED}


def lint(d, config: Mapping, target_layers: int | None, record: dict | None) -> list[Finding]:
    """The MTP export's own findings (serving/lint.py adds the checks against the target): its config, layer index,
    tensors, shared tables and how it was trained."""
    headers, trained, out = read_export(d, record)
    if record is None:
        out.append(("warning", "no-training-record", f"no {RECORD}: how the module was chained in training cannot "
                    "be checked (vLLM 0.32 feeds shared_head.norm(out) back)", "export with Fledge, or confirm it"))
    return out + findings(config, headers, target_layers, trained)


def findings(config: Mapping, headers: Mapping[str, tuple[list[int], str]] | None, target_layers: int | None,
             trained: Any) -> list[Finding]:
    """What would make vLLM serve this MTP export otherwise than it was trained (``trained``: the training record's
    spec, or None), or not load it; ``headers``: {tensor: (shape, dtype)} of its safetensors."""
    out = _config_findings(config, target_layers)
    if trained is not None:
        out += _trained_findings(config, trained)
    if headers is not None and not any(f[0] == "error" for f in out):
        out += _tensor_findings(config, headers)
    return out


def _config_findings(config: Mapping, target_layers: int | None) -> list[Finding]:
    out: list[Finding] = []
    n = config.get("num_nextn_predict_layers")
    if n != 1:
        out.append(("error", "mtp-layers", f"num_nextn_predict_layers={n!r}: vLLM builds that many MTP layers and "
                    "loads model.layers.{num_hidden_layers + i} for each (0 or none: no layer, every tensor skipped)",
                    'set "num_nextn_predict_layers": 1 (vLLM runs the one module for every draft)'))
    L = config.get("num_hidden_layers")
    if target_layers is not None and L != target_layers:
        out.append(("error", "mtp-layer-index", f"num_hidden_layers={L} but the target has {target_layers}: vLLM "
                    f"reads the module at model.layers.{L}.*, not the target's MTP index {target_layers}",
                    f'set "num_hidden_layers": {target_layers} and name the tensors model.layers.{target_layers}.*'))
    if config.get("quantization_config"):
        out.append(("error", "mtp-quantized", "quantization_config is set: vLLM would load the draft as quantized "
                    "weights, while an MTP export is bf16", "remove quantization_config from the export's config"))
    return out


def _trained_findings(config: Mapping, trained: Any) -> list[Finding]:
    out: list[Finding] = []
    if not getattr(trained, "norm_output", True):
        out.append(("error", "mtp-feedback", "the module was trained feeding its pre-norm output back "
                    "(norm_output=false), but vLLM 0.32 feeds shared_head.norm(out) to every draft after the first "
                    f"({SOURCES}): it would draft from states it never saw", "train with drafter.norm_output=true"))
    own = getattr(trained, "target_config", None) or {}
    moved = sorted(k for k in set(own) | set(config) if k not in _UNSHAPED and own.get(k) != config.get(k))
    if own and moved:
        out.append(("error", "mtp-config-trained", f"config.json differs from the target the module was trained "
                    f"with in {moved[:6]}: vLLM builds the layer from config.json", "re-export the drafter"))
    return out


def _tensor_findings(config: Mapping, headers: Mapping[str, tuple[list[int], str]]) -> list[Finding]:
    out: list[Finding] = []
    L = int(config["num_hidden_layers"])
    prefix = f"model.layers.{L}."
    expected = expected_tensors(config)
    outside = [name for name in headers if not name.startswith(prefix)]
    misplaced = [name for name in outside if any(f".{part}" in name for part in _MODULE_ONLY)]
    if misplaced:
        out.append(("error", "mtp-layer-index", f"MTP tensors outside {prefix}*, e.g. {misplaced[:3]}: vLLM loads the "
                    f"module from layer num_hidden_layers={L} only and skips these without a word",
                    f"name the module's tensors {prefix}* (num_hidden_layers is the target's layer count)"))
    if len(outside) > len(misplaced):
        out.append(("note", "mtp-other-tensors", f"{len(outside) - len(misplaced)} tensors outside {prefix}* (the "
                    "target's own, when the directory is the target's): vLLM's MTP loader skips them", "none needed"))
    for name, (shape, dtype) in headers.items():
        if not name.startswith(prefix):
            continue
        if name[len(prefix):] in _SHARED:
            out.append(("note", "mtp-shared-copy", f"{name} is shipped, but vLLM replaces the MTP module's embedding "
                        "and shared head with the target's: a copy that differs from them is dropped at load",
                        "none for a target's own copies; a Fledge export leaves them out"))
        elif name not in expected:
            out.append(("error", "unexpected-tensor", f"unexpected tensor {name} {shape}: not a tensor of the layer "
                        "config.json describes", "remove it, or export from a drafter of this target"))
        elif tuple(shape) != expected[name]:
            out.append(("error", "shape", f"{name} has shape {shape}, config.json implies {list(expected[name])}",
                        "re-export the drafter (config.json must be its target's)"))
        elif dtype != "BF16":
            out.append(("warning", "dtype", f"{name} is {dtype}, expected BF16", f"cast {name} to bfloat16"))
    missing = sorted(set(expected) - set(headers))
    if missing:
        out.append(("error", "missing-tensor", f"{len(missing)} tensors of the MTP layer missing, e.g. {missing[:4]}: "
                    "vLLM leaves them at their initial values (or refuses the draft when the whole layer is absent)",
                    "re-export the drafter"))
    return out


# ------------------------------------------------------------------------------------------ loading and serving


def load(d, spec: DrafterSpec, embed_weight, head_weight, target, dtype) -> nn.Module:
    """The MTP drafter of the directory ``d`` (an export, or a target's own directory) for the in-process harness,
    with the target's embedding and lm_head (given, or read from ``target``), as vLLM shares them."""
    L = spec.target_num_hidden_layers
    state = module_state_dict(read_tensors(d, [n for n in tensor_headers(d) if n.startswith(f"model.layers.{L}.")]), L)
    drafter = MtpDrafter(spec)
    missing, unexpected = drafter.module.load_state_dict({n: t.to(dtype) for n, t in state.items()}, strict=False)
    if set(missing) - set(_SHARED) or unexpected:
        raise ValueError(f"{d}: tensors do not match the MTP module (missing {sorted(set(missing) - set(_SHARED))[:5]}"
                         f", unexpected {sorted(unexpected)[:5]}); run `fledge lint` on it")
    if embed_weight is None and target is not None:
        embed_weight = load_input_embeddings(target)
    if head_weight is None and target is not None:
        head_weight = load_lm_head_rows(target, None, torch.arange(spec.vocab_size))
    if embed_weight is None or head_weight is None:
        raise ValueError(f"{d}: an MTP drafter uses the target's embedding and lm_head (vLLM shares them): pass the "
                         "target (embed_weight=/head_weight= or target=)")
    drafter.load_target(embed_weight.float(), head_weight.float())
    return drafter.to(dtype)


def speculative_config(config: Mapping, model: str, k: int) -> dict:
    """vLLM's ``speculative_config`` serving the MTP module in ``model`` beside its target: ``k`` drafts by the one
    module, each fed the step before's ``shared_head.norm(out)``."""
    return {"method": "mtp", "model": str(model), "num_speculative_tokens": int(k)}


def card(config: Mapping, record: dict, repo_id: str, served: dict) -> tuple[list[str], list[str]]:
    """The card's own sections for an MTP export (serving/card.py adds the measured ones) and its tags."""
    target = (record.get("target") or {}).get("name_or_path") or "<target>"
    spec = record.get("spec") or {}
    parts = [
        f"# {repo_id.split('/')[-1]}\n",
        f"The multi-token-prediction (MTP) module of **{target}**, fine-tuned with Fledge as a multi-step drafter: "
        "trained with training-time test over its own chained drafts, as vLLM chains it. The target verifies every "
        "draft, so outputs are the target's own.\n",
        "## Drafter\n",
        f"- format: the target's MTP layer (`model.layers.{config.get('num_hidden_layers')}.*`, "
        "`num_nextn_predict_layers: 1`), vLLM's `DeepSeekMTPModel`; the target's embedding and lm_head are shared, "
        "not shipped",
        f"- fed back between drafts: `shared_head.norm(out)` (norm_output={spec.get('norm_output')})",
        f"- trained steps: {record.get('step')}\n",
        "## Serving\n",
        f"```bash\nvllm serve {target} --speculative-config '{json.dumps(served)}'\n```\n",
        "SGLang: not given; this export was served and measured with vLLM only.\n",
    ]
    return parts, ["speculative-decoding", "mtp", "drafter"]
