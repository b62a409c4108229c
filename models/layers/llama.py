"""The ``llama`` drafter layer: vLLM's ``LlamaForCausalLMEagle3`` (llama_eagle3.py): q/k/v/o projections,
GQA, neox RoPE."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fledge.models.layers.kind import LayerKind, register_layer_kind


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


def attention_tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    """The q/k/v/o projections' serving names and shapes (the Qwen3 layer's too)."""
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or H // heads)
    a = f"{p}self_attn."
    return {f"{a}q_proj.weight": (heads * hd, 2 * H), f"{a}k_proj.weight": (kv * hd, 2 * H),
            f"{a}v_proj.weight": (kv * hd, 2 * H), f"{a}o_proj.weight": (H, heads * hd)}


LLAMA = register_layer_kind(LayerKind("llama", "llama", "LlamaForCausalLMEagle3", LlamaAttention, attention_tensors,
                                      aliases=("Eagle3LlamaForCausalLM",)))
