"""The serving layout of a drafter, computed from the target's config alone (docs/serving.md, The export).

The target's family (models/families.py) gives the drafter layer's settings; the export dialect
(serving/dialects.py) wraps them with the Eagle-3 fields into config.json and names the tensors.

Decisions (the model card and the linter rely on them):
- ``fc_norm`` and ``norm_output`` are always written, true or false. Engines read an absent key as false,
  so writing ``false`` is equivalent for them, and an explicit value lets the linter tell "EAGLE-3 on
  purpose" from "flags lost". ``norm_before_fc`` is written only when true (older option).
- RoPE is written the way both engines (and transformers 4 and 5) read it: ``rope_theta`` and
  ``rope_scaling`` (``null`` for plain RoPE) at the top level, plus ``rope_parameters`` with the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fledge.conf.drafter_rules import drafter_problems, raise_problems
from fledge.models.algorithms import mask_token_id_for
from fledge.models.families import read_target, text_config_dict
from fledge.models.layers.kind import get_layer_kind, kind_of_config, layer_settings, resolve_layer_kind
from fledge.serving.dialects import ServingFields, dialect_of, get_dialect
from fledge.serving.layouts import layout_for, layout_of


def _flag(drafter: Any, name: str) -> bool:
    value = drafter.get(name, False) if isinstance(drafter, Mapping) else getattr(drafter, name, False)
    return bool(value)


def _opt(drafter: Any, name: str) -> Any:
    return drafter.get(name) if isinstance(drafter, Mapping) else getattr(drafter, name, None)


def serving_config(
    target_config: Any,
    drafter: Any,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    fmt: str = "hf",
    target_name: str | None = None,
    speculative_tokens: int = 5,
) -> dict:
    """The drafter's config.json in dialect ``fmt`` (a name in serving/dialects.py's DIALECTS).

    ``drafter`` is anything carrying the flags ``fc_norm``, ``norm_output``, ``norm_before_fc`` (a
    ``DrafterConfig``, a ``DrafterSpec`` or its dict); when it also carries ``hidden_size`` /
    ``intermediate_size`` those win over the target's (a drafter narrower than its target).
    ``target_name`` (hub id or path) is required by the speculators dialect (``verifier.name_or_path``).
    """
    dialect = get_dialect(fmt)
    family, shape = read_target(target_config)
    Ht, V, L = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers
    ids = [int(i) for i in aux_layer_ids]
    fc_norm, norm_output, nbf = (_flag(drafter, k) for k in ("fc_norm", "norm_output", "norm_before_fc"))
    layout = layout_for(drafter)
    if layout is None:  # a layout's spec holds its own ids' rules (an MTP module reads id L, past EAGLE's range)
        raise_problems(drafter_problems(ids, L, fc_norm=fc_norm, norm_before_fc=nbf,
                                        draft_vocab_size=draft_vocab_size, vocab_size=V, prefix=""))
    kind = resolve_layer_kind(_opt(drafter, "layer"), family.layer_kind)
    layer = family.drafter_layer(shape)
    for key in ("hidden_size", "intermediate_size"):  # a drafter narrower than its target keeps its own widths
        if _opt(drafter, key):
            layer[key] = int(_opt(drafter, key))
    layer = layer_settings(kind, layer, text_config_dict(target_config))
    for key in kind.spec_keys:  # a trained spec's own widths win over what the target implies
        if _opt(drafter, key) is not None and _opt(drafter, key) != 0:
            layer[key] = _opt(drafter, key)
    H = layer["hidden_size"]
    if layout is not None:  # not EAGLE's: its own layout (serving/layouts.py)
        return layout.build_config(layer, drafter, ids, Ht, L)
    flags = {"fc_norm": fc_norm, "norm_output": norm_output, **({"norm_before_fc": True} if nbf else {})}
    if _flag(drafter, "parallel_drafting"):  # P-EAGLE: vLLM reads the slots' token from config.json's mask_token_id
        flags["mask_token_id"] = mask_token_id_for(drafter, target_config, V)
    return dialect.build(ServingFields(
        layer=layer, flags=flags, aux_layer_ids=ids, draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=Ht if H != Ht else None, target_name=target_name,
        target_architectures=list(shape.architectures), speculative_tokens=int(speculative_tokens),
        target_num_hidden_layers=L))


def layer_config(config: Mapping) -> dict:
    """The drafter layer's settings of an exported config of any dialect, with the Eagle-3 fields merged
    in under the HF dialect's key names (flags, ``aux_layer_ids``, draft vocab, target hidden size)."""
    return dialect_of(config).read(config)


def parallel_drafting(config: Mapping) -> bool:
    """Whether an exported config.json (any dialect) is a P-EAGLE drafter's: it names the ``mask_token_id`` vLLM
    feeds the parallel slots (and then wants ``mask_hidden`` and ``parallel_drafting`` in its speculative config)."""
    return layer_config(config).get("mask_token_id") is not None


def vllm_speculative_config(config: Mapping, model: str, k: int) -> dict:
    """vLLM's ``speculative_config`` serving the export whose config.json is ``config``, loaded from ``model`` (a
    path or hub id), with ``k`` speculative tokens. The one place it is built: the eval stage sends it
    (serving/engine.py), the model card prints it and the dialects' commands carry it, so that a card serves an
    export exactly as the eval measured it. An EAGLE export gets method eagle3, plus ``parallel_drafting`` for a
    P-EAGLE one (vLLM reads that only from here: without it vLLM runs the drafter as a chain drafter, without a
    word); any other algorithm its layout's (serving/layouts.py)."""
    layout = layout_of(config)
    if layout is not None:
        return layout.speculative_config(config, str(model), int(k))
    parallel = {"parallel_drafting": True} if config and parallel_drafting(config) else {}
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": int(k), **parallel}


def expected_tensors(config: Mapping, include_embed: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} an exported config.json (any dialect) implies, per docs/serving.md, The export.

    ``d2t``/``t2d`` are listed even when Vd = V (the export always writes them; a public checkpoint may omit
    them then); ``embed_tokens.weight`` only with ``include_embed``.
    """
    c = layer_config(config)
    H, V, I = int(c["hidden_size"]), int(c["vocab_size"]), int(c["intermediate_size"])
    Ht = int(c.get("target_hidden_size") or H)
    Vd = int(c.get("draft_vocab_size") or V)
    kind = kind_of_config(c) or get_layer_kind("llama")  # an unknown model_type: lint reports it; read as llama
    n = len(c.get("aux_layer_ids") or [0, 0, 0])
    p, bf = dialect_of(config).layer_prefix, torch.bfloat16
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"fc.weight": ((H, n * Ht), bf)}
    if c.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": ((Ht,), bf) for i in range(n)})
    if c.get("norm_before_fc"):
        out["input_norm.weight"] = ((n * Ht,), bf)
    if parallel_drafting(config):  # P-EAGLE's slot state (vLLM refuses a parallel drafter without it)
        out["mask_hidden"] = ((1, n * Ht), bf)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"{p}{name}.weight"] = ((H,), bf)
    out.update({name: (shape, bf) for name, shape in kind.tensors(c, p, H).items()})
    out[f"{p}mlp.gate_proj.weight"] = ((I, H), bf)
    out[f"{p}mlp.up_proj.weight"] = ((I, H), bf)
    out[f"{p}mlp.down_proj.weight"] = ((H, I), bf)
    out["norm.weight"] = ((H,), bf)
    out["lm_head.weight"] = ((Vd, H), bf)
    out["d2t"] = ((Vd,), torch.int64)
    out["t2d"] = ((V,), torch.bool)
    if include_embed:
        out["embed_tokens.weight"] = ((V, H), bf)
    return out
