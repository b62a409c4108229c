"""The ``qwen3`` drafter layer: vLLM's ``Eagle3Qwen3ForCausalLM`` (qwen3_eagle3.py, ``model_type: qwen3``): the
Llama layer plus a per-head RMSNorm of q and k (``q_norm``, ``k_norm``, width head_dim) before RoPE."""

from __future__ import annotations

from collections.abc import Mapping

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fledge.models.kernels.rmsnorm import RMSNorm
from fledge.models.layers.kind import Finding, LayerKind, register_layer_kind
from fledge.models.layers.llama import LlamaAttention, attention_tensors


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


def _tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    hd = int(c.get("head_dim") or H // int(c["num_attention_heads"]))
    return {**attention_tensors(c, p, H), f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,)}


def _keys(layer: dict, target: Mapping) -> dict:
    return {"head_dim": layer["head_dim"]}  # Qwen3's config spells head_dim out (the q/k norms' width)


def _checks(c: Mapping) -> list[Finding]:
    if not c.get("head_dim"):
        return [("error", "head-dim", "a qwen3 drafter layer's config.json lacks head_dim (the q/k norms' width)",
                 "set head_dim from the training record's spec")]
    return []


QWEN3 = register_layer_kind(LayerKind("qwen3", "qwen3", "Eagle3Qwen3ForCausalLM", Qwen3Attention, _tensors,
                                      settings=_keys, checks=_checks))
