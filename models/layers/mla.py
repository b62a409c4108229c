"""The ``mla`` drafter layer: vLLM's ``Eagle3DeepseekV2ForCausalLM`` (deepseek_eagle3.py, ``model_type:
deepseek_v2``; see the registration for why not v3): multi-head latent attention over the 2H input.

q = q_b_proj(q_a_layernorm(q_a_proj(z))) (or q_proj(z) when ``q_lora_rank`` is null), split per head into
``qk_nope_head_dim`` + ``qk_rope_head_dim``; kv_a_proj_with_mqa(z) = [c_kv (``kv_lora_rank``) | k_pe
(``qk_rope_head_dim``, one for all heads)]; kv_b_proj(kv_a_layernorm(c_kv)) = per head [k_nope | v
(``v_head_dim``)]; RoPE on the rope parts only, interleaved pairs (vLLM's ``is_neox_style=False``); softmax
scale qk_head_dim^-0.5, times mscale^2 for DeepSeek's yarn. No MoE. The speculators format has no MLA layer
(speculators 0.9.0's Eagle3 builds llama or qwen3 layers, and vLLM's adapter maps only those two
model_types): that export is refused.

The latent compression lives in the projections; the TTT attention sees ordinary per-head q, k, v (k's rope
part broadcast over heads), so the memory-linear CPU path, flex and the dense reference run it unchanged.
Heads whose v width differs from the qk width are zero-padded to one width for the attention call and cut
back after (q is pre-scaled so every path applies the MLA softmax scale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from fledge.models.kernels.rmsnorm import RMSNorm
from fledge.models.layers.kind import Finding, LayerKind, register_layer_kind

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# DeepSeek-V3's MLA widths (Kimi-K2's too): what a non-MLA target's MLA drafter gets. vLLM's MLA attention
# caches kv_lora_rank + qk_rope_head_dim per token and its backends take only 320 / 512 / 576 of it (its
# CPU ones, and FlashMLA, 576 alone), so other widths train but do not serve.
MLA_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}
SERVED_LATENT = (320, 512, 576)
# On an AMX CPU vLLM picks AMX_MLA for MLA attention, which computes (and packs weights) in bf16 only while
# the CPU engine runs in float32; CPU_MLA (vllm/platforms/cpu.py get_attn_backend_cls) runs both. An MLA
# drafter and an MLA target both need it.
CPU_BACKEND = "CPU_MLA"


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


def _tensors(c: Mapping, p: str, H: int) -> dict[str, tuple[int, ...]]:
    n, a = int(c["num_attention_heads"]), f"{p}self_attn."
    ql, kvl = c.get("q_lora_rank"), int(c["kv_lora_rank"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    out = ({f"{a}q_a_proj.weight": (int(ql), 2 * H), f"{a}q_a_layernorm.weight": (int(ql),),
            f"{a}q_b_proj.weight": (n * (nope + rope), int(ql))}
           if ql else {f"{a}q_proj.weight": (n * (nope + rope), 2 * H)})
    out.update({f"{a}kv_a_proj_with_mqa.weight": (kvl + rope, 2 * H), f"{a}kv_a_layernorm.weight": (kvl,),
                f"{a}kv_b_proj.weight": (n * (nope + v), kvl), f"{a}o_proj.weight": (H, n * v)})
    return out


def mla_dims(layer: Mapping, target: Mapping) -> dict:
    """The MLA widths: the target's own when it is an MLA model (DeepSeek-V3, Kimi-K2), else MLA_DEFAULTS."""
    if target.get("kv_lora_rank"):
        q = target.get("q_lora_rank")
        return {"q_lora_rank": int(q) if q else None, **{k: int(target[k]) for k in MLA_KEYS[1:]}}
    return dict(MLA_DEFAULTS)


def _checks(c: Mapping) -> list[Finding]:
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
        latent = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        out.append(("warning", "mla-latent", f"kv_lora_rank + qk_rope_head_dim = {latent}"
                    f": vLLM's MLA attention serves only {list(SERVED_LATENT)} (CPU and FlashMLA: 576)",
                    "train with kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek-V3's) to serve with vLLM"))
    return out


def _target_checks(c: Mapping, target: Mapping) -> list[Finding]:
    if target.get("kv_lora_rank"):
        return []
    return [("warning", "mla-target", "an MLA drafter of a non-MLA target: vLLM 0.32 serves MLA drafters only "
             "beside MLA targets (its MLA metadata takes the target's head size)",
             "train drafter.layer=llama (or qwen3) for this target")]


def _rope_dim(spec) -> int:
    return spec.qk_rope_head_dim  # RoPE spans the rope part of each head only


# model_type deepseek_v2, not v3: vLLM rewrites a draft config of model_type deepseek_v3 into its MTP module
# (SpeculativeConfig.hf_config_override), which then fails to load as an EAGLE-3 drafter.
MLA = register_layer_kind(LayerKind("mla", "deepseek_v2", "Eagle3DeepseekV2ForCausalLM", MLAAttention, _tensors,
                                    settings=mla_dims, spec_keys=MLA_KEYS, checks=_checks,
                                    target_checks=_target_checks, speculators=False,
                                    aliases=("Eagle3DeepseekV3ForCausalLM",), rope_dim=_rope_dim,
                                    cpu_attention_backend=CPU_BACKEND))
