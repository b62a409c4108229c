"""Target families: how a drafter is shaped from its target's config (an extension point).

Every place that reads a target's config.json (the drafter spec, the serving config, the linter, the
frozen target's checks) goes through ``read_target``: the text part of the config (multimodal wrappers
nest it under ``text_config``) is looked up by ``model_type`` in ``FAMILIES`` and read by that family into
a ``TargetShape``, from which the family's ``drafter_layer`` builds the drafter layer's settings.

Registered: ``llama``, ``qwen3`` and ``qwen3_moe``, all with the Llama drafter layer (what vLLM's
llama_eagle3.py / qwen3 support and SGLang's LlamaForCausalLMEagle3 run), and ``deepseek_v3`` (model types
``deepseek_v3`` and ``kimi_k2``: DeepSeek-V3, Kimi-K2 and the text part of Kimi-K2.5/2.6), read by
``read_mla_config``. To add a target whose decoder is
Llama-shaped (RMSNorm, SiLU-gated MLP, RoPE, grouped-query attention), add its model_type to a family below
and a test to tests/unit/models/test_families.py. What the shared reader already handles:

- MoE targets: the drafter's MLP is dense, so it takes the dense ``intermediate_size``, never the
  per-expert ``moe_intermediate_size``; a config with only the latter is refused (pick a width).
- a missing ``head_dim`` (or null) is ``hidden_size // num_attention_heads``; missing kv heads = heads.
- RoPE from ``rope_parameters`` (transformers 5) or legacy ``rope_theta`` + ``rope_scaling`` (``type`` or
  ``rope_type``), yarn included; llama3 / yarn / longrope get ``original_max_position_embeddings`` filled in
  the way transformers does (the drafter is trained with transformers' RoPE, and vLLM needs the key).
- MTP layers (DeepSeek-V3's ``num_nextn_predict_layers``): config.json's ``num_hidden_layers`` (61) already
  excludes them though the weights hold them as ``model.layers.61.*``; aux ids range over the 61 only, and
  models/weights.py never takes the MTP module's embedding or head copies.

DeepSeek-V3 / Kimi-K2 (MLA attention, MoE): ``read_mla_config`` keeps the MLA widths in
``TargetShape.mla`` (q/kv LoRA ranks, nope/rope/v head dims); the family's ``layer_kind="mla"`` builds vLLM's
deepseek_eagle3.py layer (models/layers/mla.py reads those widths). transformers' ``head_dim`` of these configs is
the RoPE width (``qk_rope_head_dim``), not an attention head's, so a Llama drafter layer chosen with
``drafter.layer=llama`` gets ``hidden_size // num_attention_heads``.

An unknown model_type is an error, not a fallback to llama: a wrong guess about a config (per-layer RoPE,
MLA, a head_dim that is not hidden/heads) builds a drafter that trains and exports cleanly and then serves
with acceptance near 1, the silent failure this project exists to prevent (docs/serving.md, Silent failures).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fledge.registry import Registry

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings",
             "rms_norm_eps")
# RoPE types whose frequencies depend on the pretraining length (transformers' standardize_rope_params).
_ORIGINAL_MAX_ROPE = ("llama3", "yarn", "longrope")


def text_config_dict(config: Any) -> dict:
    """A target config (dict, PretrainedConfig, or a multimodal one) as a plain dict of its language model's
    fields; ``model_type`` and ``architectures`` come from the outer config when the text part lacks them."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    d = dict(config)
    inner = d.get("text_config")
    if inner is not None and "hidden_size" not in d:  # multimodal wrappers keep the LM's fields nested
        inner = dict(inner.to_dict() if hasattr(inner, "to_dict") else inner)
        for key in ("model_type", "architectures"):
            if inner.get(key) is None and d.get(key) is not None:
                inner[key] = d[key]
        d = inner
    return d


def rope_of(config: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None for plain RoPE) of a config dict, read from transformers 5's
    ``rope_parameters`` or the legacy top-level ``rope_theta`` / ``rope_scaling``."""
    params = config.get("rope_parameters")
    if params:
        if all(isinstance(v, Mapping) for v in params.values()):  # keyed by layer type (sliding / full)
            raise ValueError(f"target rope_parameters={dict(params)}: per-layer-type RoPE is not supported by "
                             "the drafter (its one layer has one RoPE)")
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta", config.get("rope_theta", 10000.0)))
    else:  # transformers 5 may have copied rope_theta into rope_scaling: the dict's own value wins
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
        theta = float(scaling.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("type", None)
    rope_type = scaling.get("rope_type", rope_type or "default")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    if rope_type in _ORIGINAL_MAX_ROPE:  # as transformers does: a top-level value wins, else the max positions
        if config.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings"):
            scaling.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return theta, scaling


@dataclass(frozen=True)
class TargetShape:
    """What a drafter takes from its target, read once from the target's config."""

    model_type: str
    num_hidden_layers: int  # the decoder layers aux ids index; MTP layers are not among them
    hidden_size: int
    intermediate_size: int  # dense MLP width (MoE targets: not the per-expert width)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool = False
    mtp_layers: int = 0  # num_nextn_predict_layers: stored after the decoder layers, never counted in them
    architectures: tuple[str, ...] = ()
    token_ids: dict = field(default_factory=dict)  # bos / eos / pad, copied into the serving config
    # MLA targets (DeepSeek-V3, Kimi-K2): q_lora_rank (None: no q compression), kv_lora_rank, qk_nope_head_dim,
    # qk_rope_head_dim, v_head_dim; None for every other target.
    mla: dict | None = None

    @property
    def rope_parameters(self) -> dict:
        """RoPE in transformers 5's form: ``{"rope_type": ..., "rope_theta": ..., <scaling fields>}``."""
        return {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}


def read_decoder_config(d: Mapping[str, Any]) -> TargetShape:
    """The shape of a Llama-shaped decoder (Llama, Qwen3, their MoE variants) from its text config dict."""
    for key in _REQUIRED:
        if d.get(key) in (None, ""):
            raise ValueError(f"target config lacks {key!r}: give the target's config.json (or set it in "
                             "target.config_overrides)")
    if d.get("intermediate_size") in (None, 0):
        hint = " (it has only the per-expert moe_intermediate_size)" if d.get("moe_intermediate_size") else ""
        raise ValueError(f"target config lacks a dense 'intermediate_size'{hint}: the drafter's MLP is dense; set "
                         "target.config_overrides.intermediate_size to the width the drafter should use")
    H, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if not d.get("head_dim") and H % heads:
        raise ValueError(f"target config has no head_dim and hidden_size={H} is not a multiple of "
                         f"num_attention_heads={heads}: set head_dim in target.config_overrides")
    theta, scaling = rope_of(d)
    return TargetShape(
        model_type=str(d.get("model_type")),
        num_hidden_layers=int(d["num_hidden_layers"]),
        hidden_size=H,
        intermediate_size=int(d["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or H // heads),
        hidden_act=str(d.get("hidden_act") or "silu"),
        rms_norm_eps=float(d["rms_norm_eps"]),
        max_position_embeddings=int(d["max_position_embeddings"]),
        vocab_size=int(d["vocab_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0),
        architectures=tuple(d.get("architectures") or ()),
        token_ids={k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if d.get(k) is not None},
    )


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def read_mla_config(d: Mapping[str, Any]) -> TargetShape:
    """The shape of a DeepSeek-V3-style decoder (MLA attention, MoE; DeepSeek-V3, Kimi-K2): the MLA widths go
    to ``TargetShape.mla``; ``head_dim`` (transformers sets it to the RoPE width) is not an attention head's
    width, so the shared reader sees none; its kv heads are the attention heads (MLA has no GQA)."""
    missing = [k for k in _MLA_FIELDS if k not in d or (d[k] in (None, 0) and k != "q_lora_rank")]
    if missing:
        raise ValueError(f"target model_type={d.get('model_type')!r} is an MLA target but its config lacks "
                         f"{missing}: give the target's config.json (or set them in target.config_overrides)")
    plain = {k: v for k, v in d.items() if k not in ("head_dim", "num_key_value_heads")}
    shape = read_decoder_config(plain)
    mla = {k: (int(d[k]) if d[k] is not None else None) for k in _MLA_FIELDS}
    return TargetShape(**{**shape.__dict__, "mla": mla})


def llama_drafter_layer(shape: TargetShape) -> dict:
    """The Llama drafter layer's settings (config.json keys, docs/serving.md, The export), copied from the target."""
    return {
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": shape.hidden_act,
        "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position_embeddings,
        # Both spellings: vLLM and SGLang (transformers 4 style) read rope_theta / rope_scaling, transformers
        # 5 reads rope_parameters; all three hold the same values.
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "rope_parameters": shape.rope_parameters,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        **shape.token_ids,
    }


@dataclass(frozen=True)
class TargetFamily:
    """How drafters are shaped for targets of the listed transformers ``model_type`` values.

    ``layer_kind`` names the drafter layer kind (models/layers/) ``drafter.layer=auto`` builds for them; ``read`` turns
    the target's text config dict into a TargetShape; ``drafter_layer`` turns that into the drafter layer's config keys
    (``model_type``, widths, heads, RoPE, ...), which both the drafter spec and the serving config use.
    """

    name: str
    model_types: tuple[str, ...]
    layer_kind: str = "llama"
    read: Callable[[Mapping[str, Any]], TargetShape] = read_decoder_config
    drafter_layer: Callable[[TargetShape], dict] = llama_drafter_layer


# Keyed by the transformers model_type a family reads (one family may read several).
FAMILIES: Registry[TargetFamily] = Registry("the target's model_type", "models/families.py")


def register_family(family: TargetFamily, replace: bool = False) -> TargetFamily:
    """Make ``family`` the one for each of its model types; an existing entry is kept unless ``replace``."""
    taken = [mt for mt in family.model_types if mt in FAMILIES and FAMILIES.get(mt) is not family]
    if taken and not replace:
        raise ValueError(f"model_type {taken} already registered to family {FAMILIES.get(taken[0]).name!r} "
                         "(fledge/models/families.py); pass replace=True to override it")
    for mt in family.model_types:
        FAMILIES.register(mt, family, replace=True)
    return family


def family_of(config: Any) -> TargetFamily:
    """The registered family of a target config (dict or PretrainedConfig); ValueError when there is none."""
    d = text_config_dict(config)
    mt = d.get("model_type")
    if not mt:
        raise ValueError(f"target config has no model_type (keys: {sorted(d)[:12]}...): give the target's "
                         "config.json, or add model_type to target.config_overrides")
    if mt not in FAMILIES:
        raise ValueError(
            f"target model_type={mt!r} has no target family (known: {FAMILIES.names()}). If its decoder is "
            "Llama-shaped (RMSNorm, SiLU-gated MLP, RoPE, GQA), add the model_type to a family in "
            "fledge/models/families.py (models/families.py in the repository) with a test; see that file's "
            "docstring for MoE, MTP and MLA targets")
    return FAMILIES.get(mt)


def read_target(config: Any) -> tuple[TargetFamily, TargetShape]:
    """(family, shape) of a target config: the one entry point for reading a target's config."""
    family = family_of(config)
    return family, family.read(text_config_dict(config))


register_family(TargetFamily("llama", ("llama",)))
register_family(TargetFamily("qwen3", ("qwen3",)))  # q/k norms live in the target only: Llama drafter layer
register_family(TargetFamily("qwen3_moe", ("qwen3_moe",)))  # dense intermediate_size for the drafter MLP
# DeepSeek-V3 and Kimi-K2 (config.json model_type "kimi_k2", architecture DeepseekV3ForCausalLM; K2.5/2.6 nest
# it under text_config): the MLA drafter layer (vLLM's deepseek_eagle3.py) by default; drafter.layer=llama
# picks the Llama layer, which vLLM's llama_eagle3.py also serves on these targets.
register_family(TargetFamily("deepseek_v3", ("deepseek_v3", "kimi_k2"), read=read_mla_config, layer_kind="mla"))
