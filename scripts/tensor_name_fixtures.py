"""Write the tensor-name fixtures of tests/fixtures/tensor_names/ (names only, no weights).

The real ``model.safetensors.index.json`` files of these targets are not stored where this project can read
them, so their names are rebuilt from the modeling code: each target is instantiated by transformers (the
version in .venv) with its real structure (layer counts, experts, MLA ranks, vision depth) and tiny widths,
saved with ``save_pretrained`` (which writes the checkpoint names, undoing transformers' load-time renames),
and the names are read back. Then what transformers does not write is added, each from the source named:

- DeepSeek-V3's MTP module, stored as decoder layer 61 (``num_nextn_predict_layers: 1``; transformers skips
  it on load): the names vLLM's model_executor/models/deepseek_mtp.py reads (``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens`` and one decoder layer), and the
  FP8 block scales (``weight_scale_inv``) beside every projection of the decoder layers.
- Kimi-K2.6 (model_type kimi_k25, the class transformers documents for moonshotai/Kimi-K2.6): see
  kimi_k2_6 below for where each part's names come from; routed experts in compressed-tensors INT4
  (``weight_packed``, ``weight_scale``, ``weight_shape`` in place of ``weight``).

Routed experts are listed for the first and the last expert only (the others have the same names with
other indices; 256 x 58 x 3 of them would make the files megabytes for no test). Run:
    .venv/bin/python scripts/tensor_name_fixtures.py
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tensor_names"
TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
            vocab_size=64)


def _names(model) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, max_shard_size="1GB")
        from safetensors import safe_open

        names = []
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                names += list(st.keys())
    return sorted(set(names))


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _keep_first_and_last_expert(names: list[str], n_experts: int) -> list[str]:
    return [n for n in names if not (m := _EXPERT.search(n)) or int(m.group(1)) in (0, n_experts - 1)]


def deepseek_v3() -> dict:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    L, E = 61, 256
    cfg = DeepseekV3Config(**{**TINY, "num_key_value_heads": 2}, num_hidden_layers=L, n_routed_experts=E,
                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=3, moe_intermediate_size=8,
                           q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                           n_group=8, topk_group=4, tie_word_embeddings=False)
    names = _names(DeepseekV3ForCausalLM(cfg))
    # The MTP module (vLLM deepseek_mtp.py): its own embedding, norms, projection and head, then one decoder
    # layer (a MoE layer, as every layer past first_k_dense_replace) under the same layer index.
    mtp = [f"model.layers.{L}.{n}" for n in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                                              "shared_head.norm.weight", "shared_head.head.weight")]
    mtp += [n.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.") for n in names
            if n.startswith(f"model.layers.{L - 1}.")]
    names = sorted(set(names + mtp))
    scales = [n[:-len("weight")] + "weight_scale_inv" for n in names
              if re.search(r"\.layers\.\d+\..*_proj(_with_mqa)?\.weight$", n) and ".eh_proj." not in n]
    names = _keep_first_and_last_expert(sorted(set(names + scales)), E)
    return {"target": "deepseek-ai/DeepSeek-V3", "num_hidden_layers": L, "num_nextn_predict_layers": 1,
            "_source": "transformers DeepseekV3ForCausalLM save_pretrained names, plus the MTP layer 61 as vLLM's "
                       "deepseek_mtp.py reads it and FP8 weight_scale_inv beside the layers' projections; routed "
                       "experts: the first and the last only",
            "names": names}


def kimi_k2_6() -> dict:
    # transformers 5.23's save_pretrained does not write Kimi-K2.5/K2.6's original names back (its reverse of
    # the kimi_k25 renames leaves "blocks" as "layers" and "model.mm_projector"), so the text part comes from
    # its DeepSeek-V3 model under the wrapper's "language_model." prefix (vLLM kimi_k25.py loads it there), and
    # the vision tower and projector are named after vLLM 0.32's kimi_k25_vit.py modules (MoonViT3d blocks
    # norm0/norm1/wqkv/wo/mlp.fc0/fc1, the projector's pre_norm and proj.0/proj.2), the names transformers'
    # conversion_mapping.py "kimi_k25" entry lists as the checkpoint's.
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    L, E, VISION_DEPTH = 61, 384, 27
    cfg = DeepseekV3Config(**TINY, num_hidden_layers=L, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2,
                           first_k_dense_replace=1, moe_intermediate_size=8, q_lora_rank=8, kv_lora_rank=8,
                           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, n_group=1, topk_group=1,
                           tie_word_embeddings=False)
    names = []
    for n in _names(DeepseekV3ForCausalLM(cfg)):
        n = "language_model." + n
        names += [n + "_packed", n + "_scale", n + "_shape"] if _EXPERT.search(n) else [n]
    block = [f"{m}.{p}" for m in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1") for p in ("weight", "bias")]
    names += [f"vision_tower.encoder.blocks.{i}.{b}" for i in range(VISION_DEPTH) for b in block]
    names += ["vision_tower.encoder.final_layernorm.weight", "vision_tower.encoder.final_layernorm.bias",
              "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias",
              "vision_tower.patch_embed.pos_emb.weight"]
    names += [f"mm_projector.{m}.{p}" for m in ("pre_norm", "proj.0", "proj.2") for p in ("weight", "bias")]
    return {"target": "moonshotai/Kimi-K2.6", "num_hidden_layers": L, "num_nextn_predict_layers": 0,
            "_source": "text: transformers DeepseekV3ForCausalLM save_pretrained names under language_model. "
                       "(routed experts INT4: weight_packed/_scale/_shape); vision tower and projector: the "
                       "modules of vLLM 0.32 kimi_k25_vit.py, as transformers' conversion_mapping.py lists them; "
                       "routed experts: the first and the last only",
            "names": _keep_first_and_last_expert(sorted(names), E)}


def qwen3_vl_8b() -> dict:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    L = 36
    cfg = Qwen3VLConfig(text_config=dict(**TINY, num_hidden_layers=L, tie_word_embeddings=False),
                        vision_config=dict(depth=27, hidden_size=16, intermediate_size=32, num_heads=2,
                                           out_hidden_size=16, num_position_embeddings=16,
                                           deepstack_visual_indexes=[8, 16, 24]),
                        tie_word_embeddings=False)
    return {"target": "Qwen/Qwen3-VL-8B-Instruct", "num_hidden_layers": L, "num_nextn_predict_layers": 0,
            "_source": "transformers Qwen3VLForConditionalGeneration save_pretrained names",
            "names": _names(Qwen3VLForConditionalGeneration(cfg))}


def llama3_1_8b() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    L = 32
    cfg = LlamaConfig(**TINY, num_hidden_layers=L, tie_word_embeddings=False)
    return {"target": "meta-llama/Llama-3.1-8B-Instruct", "num_hidden_layers": L, "num_nextn_predict_layers": 0,
            "_source": "transformers LlamaForCausalLM save_pretrained names", "names": _names(LlamaForCausalLM(cfg))}


def main() -> None:
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    for fn in (kimi_k2_6, deepseek_v3, qwen3_vl_8b, llama3_1_8b):
        fixture = fn()
        fixture["_source"] = (f"rebuilt by scripts/tensor_name_fixtures.py (transformers {transformers.__version__}): "
                              + fixture["_source"])
        (OUT / f"{fn.__name__}.json").write_text(json.dumps(fixture, indent=0) + "\n")
        print(fn.__name__, len(fixture["names"]))


if __name__ == "__main__":
    main()
