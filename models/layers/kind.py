"""Drafter layer kinds: the attention of the drafter's one decoder layer (an extension point).

``drafter.layer`` picks one: ``auto`` (the target family's ``layer_kind``, models/families.py), ``llama``,
``qwen3`` or ``mla``. Everything else of the layer (the 2H input ``[input_layernorm(emb), hidden_norm(g)]``,
the residual around the raw g, the dense SiLU MLP, the EAGLE-3.1 flags, the TTT unroll and both attention
paths of models/attention.py) is shared; a kind owns its attention module, the config.json keys and
``architectures`` vLLM builds it from, its tensor names and shapes, its lint checks, and whether the
speculators format can carry it. The spec is vLLM 0.32's model code:

- ``llama``: ``LlamaForCausalLMEagle3`` (llama_eagle3.py): q/k/v/o projections, GQA, neox RoPE.
- ``qwen3``: ``Eagle3Qwen3ForCausalLM`` (qwen3_eagle3.py, ``model_type: qwen3``): the Llama layer plus a
  per-head RMSNorm of q and k (``q_norm``, ``k_norm``, width head_dim) before RoPE.
- ``mla``: ``Eagle3DeepseekV2ForCausalLM`` (deepseek_eagle3.py, ``model_type: deepseek_v2``; see the
  registration for why not v3): multi-head
  latent attention over the 2H input. q = q_b_proj(q_a_layernorm(q_a_proj(z))) (or q_proj(z) when
  ``q_lora_rank`` is null), split per head into ``qk_nope_head_dim`` + ``qk_rope_head_dim``; kv_a_proj_with_mqa
  (z) = [c_kv (``kv_lora_rank``) | k_pe (``qk_rope_head_dim``, one for all heads)]; kv_b_proj(kv_a_layernorm(
  c_kv)) = per head [k_nope | v (``v_head_dim``)]; RoPE on the rope parts only, interleaved pairs (vLLM's
  ``is_neox_style=False``); softmax scale qk_head_dim^-0.5, times mscale^2 for DeepSeek's yarn. No MoE.
  The speculators format has no MLA layer (speculators 0.9.0's Eagle3 builds llama or qwen3 layers, and
  vLLM's adapter maps only those two model_types): that export is refused.

The latent compression lives in the projections; the TTT attention sees ordinary per-head q, k, v (k's
rope part broadcast over heads), so the memory-linear CPU path, flex and the dense reference run it
unchanged. Heads whose v width differs from the qk width are zero-padded to one width for the attention
call and cut back after (q is pre-scaled so every path applies the MLA softmax scale).
Adding a kind: an attention module with ``project(z, cos, sin) -> q, k, v`` and ``output(a) -> [B, T, H]``,
a ``LayerKind`` registered here, and its tests (tests/unit/test_layers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fledge.models.kernels.rmsnorm import RMSNorm

Finding = tuple[str, str, str, str]  # (level, code, message, fix), as serving/lint.py reports them
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


# ------------------------------------------------------------------------------------------ attention


class LlamaAttention(nn.Module):
    """q/k/v over the 2H-wide [embedding, hidden] input; o_proj back to H. Names as in serving."""

    def __init__(self, spec) -> None:
        super().__init__()
        H, D = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)

    def _heads(self, x, n):
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def project(self, z, cos, sin):
        """``z [B, T, 2H]`` -> q ``[B, Hq, T, D]``, k, v ``[B, Hkv, T, D]`` with RoPE applied."""
        q = self._heads(self.q_proj(z), self.num_heads)
        k = self._heads(self.k_proj(z), self.num_kv_heads)
        v = self._heads(self.v_proj(z), self.num_kv_heads)
        return (*apply_rotary_pos_emb(q, k, cos, sin), v)

    def output(self, a):
        """attention output ``[B, Hq, T, D]`` -> ``[B, T, H]``."""
        B, _, T, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(B, T, -1))


class Qwen3Attention(LlamaAttention):
    """The Llama attention with Qwen3's per-head RMSNorm of q and k (before RoPE)."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.q_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)

    def project(self, z, cos, sin):
        q = self.q_norm(self._heads(self.q_proj(z), self.num_heads))
        k = self.k_norm(self._heads(self.k_proj(z), self.num_kv_heads))
        v = self._heads(self.v_proj(z), self.num_kv_heads)
        return (*apply_rotary_pos_emb(q, k, cos, sin), v)


def rope_interleaved(x, cos, sin):
    """RoPE on adjacent pairs (x0, x1), (x2, x3), ... (GPT-J style; vLLM's is_neox_style=False), with
    transformers' ``cos``/``sin`` ``[B, T, D]`` (the D/2 frequencies repeated twice) broadcast over heads."""
    c, s = cos[..., : x.shape[-1] // 2].unsqueeze(1), sin[..., : x.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(spec) -> float:
    """qk_head_dim^-0.5, times mscale^2 under DeepSeek's yarn (``mscale_all_dim``), as vLLM and transformers."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    rope = spec.rope or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention over the 2H input (see the module docstring)."""

    def __init__(self, spec) -> None:
        super().__init__()
        H, n, eps = spec.hidden_size, spec.num_attention_heads, spec.rms_norm_eps
        self.num_heads, self.nope, self.rope = n, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank, self.q_lora_rank = spec.v_head_dim, spec.kv_lora_rank, spec.q_lora_rank
        qk = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * H, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(2 * H, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, H, bias=False)
        self.width = max(qk, self.v_dim)  # the one head width the attention call sees
        # q is pre-scaled so that an attention applying width^-0.5 applies the MLA scale
        self.q_scale = mla_softmax_scale(spec) * self.width**0.5

    def project(self, z, cos, sin):
        B, T, _ = z.shape
        n, qk = self.num_heads, self.nope + self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(z))) if self.q_lora_rank else self.q_proj(z)
        q = q.view(B, T, n, qk).transpose(1, 2)
        c_kv, k_pe = self.kv_a_proj_with_mqa(z).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, n, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = rope_interleaved(q[..., self.nope:], cos, sin)
        k_pe = rope_interleaved(k_pe.view(B, 1, T, self.rope), cos, sin).expand(B, n, T, self.rope)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1) * self.q_scale
        k = torch.cat([k_nope, k_pe], dim=-1)
        return _pad(q, self.width), _pad(k, self.width), _pad(v, self.width)

    def output(self, a):
        B, _, T, _ = a.shape
        return self.o_proj(a[..., : self.v_dim].transpose(1, 2).reshape(B, T, -1))


def _pad(x, width):
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


# ------------------------------------------------------------------------------------- serving layout


def _attention_tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or H // heads)
    a = f"{p}self_attn."
    return {f"{a}q_proj.weight": (heads * hd, 2 * H), f"{a}k_proj.weight": (kv * hd, 2 * H),
            f"{a}v_proj.weight": (kv * hd, 2 * H), f"{a}o_proj.weight": (H, heads * hd)}


def _qwen3_tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    hd = int(c.get("head_dim") or H // int(c["num_attention_heads"]))
    return {**_attention_tensors(c, p, H), f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,)}


def _mla_tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    n, a = int(c["num_attention_heads"]), f"{p}self_attn."
    ql, kvl = c.get("q_lora_rank"), int(c["kv_lora_rank"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    out = ({f"{a}q_a_proj.weight": (int(ql), 2 * H), f"{a}q_a_layernorm.weight": (int(ql),),
            f"{a}q_b_proj.weight": (n * (nope + rope), int(ql))} if ql else {f"{a}q_proj.weight": (n * (nope + rope), 2 * H)})
    out.update({f"{a}kv_a_proj_with_mqa.weight": (kvl + rope, 2 * H), f"{a}kv_a_layernorm.weight": (kvl,),
                f"{a}kv_b_proj.weight": (n * (nope + v), kvl), f"{a}o_proj.weight": (H, n * v)})
    return out


def _no_keys(layer: dict, target: Mapping) -> dict:
    return {}


def _qwen3_keys(layer: dict, target: Mapping) -> dict:
    return {"head_dim": layer["head_dim"]}  # Qwen3's config spells head_dim out (the q/k norms' width)


# DeepSeek-V3's MLA widths (Kimi-K2's too): what a non-MLA target's MLA drafter gets. vLLM's MLA attention
# caches kv_lora_rank + qk_rope_head_dim per token and its backends take only 320 / 512 / 576 of it (its
# CPU ones, and FlashMLA, 576 alone), so other widths train but do not serve.
MLA_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}
SERVED_LATENT = (320, 512, 576)


def mla_dims(layer: Mapping, target: Mapping) -> dict:
    """The MLA widths: the target's own when it is an MLA model (DeepSeek-V3, Kimi-K2), else MLA_DEFAULTS."""
    if target.get("kv_lora_rank"):
        q = target.get("q_lora_rank")
        return {"q_lora_rank": int(q) if q else None, **{k: int(target[k]) for k in MLA_KEYS[1:]}}
    return dict(MLA_DEFAULTS)


def _mla_checks(c: Mapping) -> list[Finding]:
    out = []
    for key in MLA_KEYS[1:]:
        if not isinstance(c.get(key), int) or c[key] <= 0:
            out.append(("error", "mla-dims", f"{key}={c.get(key)!r}: an MLA layer needs a positive {key}",
                        f"set {key} (the training record's spec has it)"))
    if isinstance(c.get("qk_rope_head_dim"), int) and c["qk_rope_head_dim"] % 2:
        out.append(("error", "mla-dims", f"qk_rope_head_dim={c['qk_rope_head_dim']} is odd: RoPE rotates pairs",
                    "use an even qk_rope_head_dim"))
    if c.get("q_lora_rank") not in (None, 0) and (not isinstance(c["q_lora_rank"], int) or c["q_lora_rank"] < 0):
        out.append(("error", "mla-dims", f"q_lora_rank={c['q_lora_rank']!r}", "a positive int, or null for q_proj"))
    if not out and c["kv_lora_rank"] + c["qk_rope_head_dim"] not in SERVED_LATENT:
        out.append(("warning", "mla-latent", f"kv_lora_rank + qk_rope_head_dim = {c['kv_lora_rank'] + c['qk_rope_head_dim']}"
                    f": vLLM's MLA attention serves only {list(SERVED_LATENT)} (CPU and FlashMLA: 576)",
                    "train with kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek-V3's) to serve with vLLM"))
    return out


def _qwen3_checks(c: Mapping) -> list[Finding]:
    if not c.get("head_dim"):
        return [("error", "head-dim", "a qwen3 drafter layer's config.json lacks head_dim (the q/k norms' width)",
                 "set head_dim from the training record's spec")]
    return []


@dataclass(frozen=True)
class LayerKind:
    """One drafter layer kind. ``settings(layer, target)`` gives the config.json keys the kind adds to the
    Llama-shaped layer settings (``layer``: families.py's drafter_layer; ``target``: the target's text config
    dict); ``spec_keys`` are those the DrafterSpec carries; ``tensors(config, prefix, H)`` the attention
    tensors' shapes; ``checks(config)`` the linter's findings; ``speculators``: whether the speculators
    format (and vLLM's adapter of it) has this layer."""

    name: str
    model_type: str  # config.json's model_type: the transformers config vLLM builds the layer from
    architecture: str  # what the hf dialect writes in config.json's architectures
    attention: Callable[[Any], nn.Module]
    tensors: Callable[[Mapping, str, int], dict[str, tuple[int, ...]]]
    settings: Callable[[dict, Mapping], dict] = _no_keys
    spec_keys: tuple[str, ...] = ()
    checks: Callable[[Mapping], list[Finding]] = lambda c: []
    speculators: bool = True
    aliases: tuple[str, ...] = ()  # other architectures names vLLM maps to the same class


LAYER_KINDS: dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind, replace: bool = False) -> LayerKind:
    if kind.name in LAYER_KINDS and not replace:
        raise ValueError(f"drafter layer kind {kind.name!r} is already registered (fledge/models/layers/kind.py)")
    LAYER_KINDS[kind.name] = kind
    return kind


def get_layer_kind(name: str) -> LayerKind:
    if name not in LAYER_KINDS:
        raise ValueError(f"drafter.layer={name!r}: expected auto or one of {sorted(LAYER_KINDS)} (a new kind is a "
                         "register_layer_kind entry in fledge/models/layers/kind.py)")
    return LAYER_KINDS[name]


def resolve_layer_kind(requested: Optional[str], family_kind: str) -> LayerKind:
    """``drafter.layer``: auto (or absent) -> the target family's layer kind."""
    return get_layer_kind(family_kind if requested in (None, "", "auto") else requested)


def check_layer_format(layer: str, fmt: str) -> None:
    """``drafter.layer`` names a kind (or auto), and an explicit kind the speculators format lacks is refused
    before any stage runs (an auto kind is checked at export, where the target is known)."""
    if layer in (None, "", "auto"):
        return
    kind = get_layer_kind(layer)
    if fmt == "speculators" and not kind.speculators:
        raise ValueError(f"drafter.layer={layer} with export.format=speculators: the speculators format has no "
                         f"{layer!r} layer (speculators 0.9.0 builds llama and qwen3 only); use export.format=hf")


def layer_settings(kind: LayerKind, layer: dict, target: Mapping) -> dict:
    """The kind's config.json keys: the Llama-shaped ``layer`` with the kind's model_type and own keys."""
    return {**layer, "model_type": kind.model_type, **kind.settings(layer, target)}


def kind_of_config(c: Mapping) -> Optional[LayerKind]:
    """The kind a drafter layer's config keys describe (by ``model_type``), None when no kind has it."""
    for kind in LAYER_KINDS.values():
        if c.get("model_type") == kind.model_type:
            return kind
    return None


def kind_of_architecture(archs) -> Optional[LayerKind]:
    for kind in LAYER_KINDS.values():
        if kind.architecture in archs or any(a in archs for a in kind.aliases):
            return kind
    return None


register_layer_kind(LayerKind("llama", "llama", "LlamaForCausalLMEagle3", LlamaAttention, _attention_tensors,
                              aliases=("Eagle3LlamaForCausalLM",)))
register_layer_kind(LayerKind("qwen3", "qwen3", "Eagle3Qwen3ForCausalLM", Qwen3Attention, _qwen3_tensors,
                              settings=_qwen3_keys, checks=_qwen3_checks))
# model_type deepseek_v2, not v3: vLLM rewrites a draft config of model_type deepseek_v3 into its MTP module
# (SpeculativeConfig.hf_config_override), which then fails to load as an EAGLE-3 drafter.
register_layer_kind(LayerKind("mla", "deepseek_v2", "Eagle3DeepseekV2ForCausalLM", MLAAttention, _mla_tensors,
                              settings=mla_dims, spec_keys=MLA_KEYS, checks=_mla_checks, speculators=False,
                              aliases=("Eagle3DeepseekV3ForCausalLM",)))
