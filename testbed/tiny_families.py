"""The tiny MoE and MLA targets' shapes: a Qwen3-MoE-shaped and a DeepSeek-V3-shaped causal LM of a few
million parameters, built and trained by testbed/tiny_writer.py (``fledge tiny-target moe|mla``) on the same
task language, tokenizer and loss as the tiny Llama, so a drafter's acceptance on them means something.

Each keeps what makes its real family different for a drafter, at CI size:
- ``moe`` (Qwen3MoeForCausalLM, like Qwen3-30B-A3B): routed experts in every layer (8 experts, top 2, the
  per-expert ``moe_intermediate_size`` apart from the dense ``intermediate_size`` the drafter takes), q/k
  norms, explicit ``head_dim``, GQA, and a *tied* lm_head (the real one is untied: the tied path is the one
  the other tiny targets do not cover).
- ``mla`` (DeepseekV3ForCausalLM, like DeepSeek-V3 / Kimi-K2): multi-head latent attention (q and kv LoRA
  compression, decoupled RoPE keys ``qk_rope_head_dim`` apart from ``qk_nope_head_dim``, ``v_head_dim``), no
  ``head_dim`` in the sense of hidden/heads, yarn ``rope_parameters`` with mscale / mscale_all_dim as the
  real ones, a first dense layer then MoE layers with a shared expert and sigmoid group routing, untied head.

The MLA latent width is the real one, kv_lora_rank 512 + qk_rope_head_dim 64 = 576: vLLM's CPU MLA backends
(CPU_MLA, AMX_MLA in v1/attention/backends/mla/) compile their decode kernel for that head size only, so a
smaller latent could not be served on CPU. Eight layers, as the tiny Llama, so the default aux ids (2, 4, 5) are
distinct. Their step counts are tiny_writer.FAMILY_BUDGETS'.
"""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    "moe": dict(model_type="qwen3_moe", vocab_size=2560, hidden_size=128, intermediate_size=256,
                moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                router_aux_loss_coef=0.001),
    "mla": dict(model_type="deepseek_v3", vocab_size=2560, hidden_size=128, intermediate_size=256,
                moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                # DeepSeek-V3's router as its config.json names it: transformers always routes this way (sigmoid
                # scores plus e_score_correction_bias); vLLM builds that bias only for topk_method noaux_tc and
                # refuses the checkpoint's bias tensor without it.
                topk_method="noaux_tc", scoring_func="sigmoid",
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                max_position_embeddings=2048, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0},
                tie_word_embeddings=False),
}
# Variants of a family's shape: mla with DeepSeek-V3's MTP module (testbed/tiny_mtp.py), its config saying so.
VARIANTS: dict[str, dict] = {"mla_mtp": dict(SHAPES["mla"], num_nextn_predict_layers=1)}


def shape(name: str) -> dict:
    """The config of the tiny ``name`` (a family of SHAPES or one of its VARIANTS)."""
    return {**SHAPES, **VARIANTS}[name]


def new_model(family: str, tok):
    """An untrained Hugging Face model of the tiny ``family`` with ``tok``'s special token ids (fp32); for
    mla_mtp the target alone (testbed/tiny_mtp.py adds its module)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = {k: v for k, v in shape(family).items() if k != "model_type"}
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config, **ids))
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config, **ids))
