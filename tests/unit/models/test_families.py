"""Target families (models/families.py): the registry is what shapes the drafter, the serving config and
the linter's view of the target; MoE, missing head_dim, yarn RoPE, text_config nesting and MTP configs."""

import contextlib

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fledge.conf.schema import DrafterConfig
from fledge.models import families
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter import Eagle3Drafter
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.families import TargetFamily, read_decoder_config, read_target, register_family
from fledge.models.weights import read_tensors
from fledge.serving.export import export_checkpoint, load_drafter
from fledge.serving.lint import compose_recipe, format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import layer_config, serving_config
from tests.helpers.models import random_state_dict

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "vocab_size": 512, "rope_theta": 10000.0}
DCFG = DrafterConfig(draft_vocab_size=128)


@pytest.fixture
def register():
    """Register a family for one test: its model types are the registry's again afterwards."""
    with contextlib.ExitStack() as stack:

        def _register(family):
            for mt in family.model_types:
                stack.enter_context(families.FAMILIES.temporary(mt, family))
            return family

        yield _register


def _spec_and_config(target, ids=(2, 4, 5), fmt="hf"):
    spec = DrafterSpec.from_target_config(target, DCFG, list(ids))
    return spec, serving_config(target, spec, list(ids), 128, fmt=fmt, target_name="t")


@pytest.mark.parametrize("recipe,family", [("llama3", "llama"), ("qwen3", "qwen3")])
def test_shipped_recipes_resolve_to_their_family(recipe, family):
    cfg = compose_recipe(recipe)
    fam, shape = read_target(cfg.target.config_overrides)
    assert fam.name == family and fam.layer_kind == "llama"
    t = cfg.target
    assert (shape.num_hidden_layers, shape.hidden_size, shape.vocab_size) == \
        (t.num_hidden_layers, t.hidden_size, t.vocab_size)


def test_unknown_or_missing_model_type_names_the_registry():
    with pytest.raises(ValueError, match=r"model_type='mistral'.*families\.py"):
        DrafterSpec.from_target_config({**BASE, "model_type": "mistral"}, DCFG, [2, 4, 5])
    with pytest.raises(ValueError, match=r"model_type='mistral'.*families\.py"):
        serving_config({**BASE, "model_type": "mistral"}, DCFG, [2, 4, 5], 128)
    no_type = {k: v for k, v in BASE.items() if k != "model_type"}
    with pytest.raises(ValueError, match="no model_type.*config_overrides"):
        read_target(no_type)
    with pytest.raises(ValueError, match="already registered"):
        register_family(TargetFamily("llama2", ("llama",)))


def test_moe_target_gives_a_dense_drafter_mlp():
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                         max_position_embeddings=4096, num_experts=4, num_experts_per_tok=2)
    spec, config = _spec_and_config(moe)
    assert spec.intermediate_size == 96 and config["intermediate_size"] == 96
    assert Eagle3Drafter(spec).midlayer.mlp.up_proj.weight.shape == (96, 64)
    only_moe = {**BASE, "model_type": "qwen3_moe", "moe_intermediate_size": 24}
    del only_moe["intermediate_size"]
    with pytest.raises(ValueError, match="dense 'intermediate_size'.*moe_intermediate_size"):
        read_target(only_moe)


@pytest.mark.parametrize("head_dim", ["absent", None])
def test_missing_head_dim_is_hidden_over_heads(head_dim):
    target = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
    if head_dim is None:
        target["head_dim"] = None  # transformers writes null for some families (Qwen3-MoE's to_dict)
    spec, config = _spec_and_config(target)
    assert spec.head_dim == 16 and config["head_dim"] == 16
    assert spec.num_key_value_heads == 4 and config["num_key_value_heads"] == 4  # kv heads default to heads
    with pytest.raises(ValueError, match="head_dim"):
        read_target({**target, "hidden_size": 66})


@pytest.mark.parametrize("rope_scaling", [
    {"type": "yarn", "factor": 4.0},  # legacy key, no original_max_position_embeddings: transformers fills it
    {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 1024},  # DeepSeek-V3's form
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},  # Qwen3's long-context form
])
def test_yarn_rope_trains_and_serves_alike(rope_scaling, tmp_path):
    target = {**BASE, "rope_theta": 1e6, "rope_scaling": rope_scaling}
    spec, config = _spec_and_config(target)
    want_omp = rope_scaling.get("original_max_position_embeddings", BASE["max_position_embeddings"])
    assert config["rope_scaling"]["rope_type"] == "yarn" and "type" not in config["rope_scaling"]
    assert config["rope_scaling"]["original_max_position_embeddings"] == want_omp
    assert spec.rope == config["rope_parameters"]  # what trains is what is served
    # the drafter's RoPE is transformers' RoPE of the target config (both the drafter and the serving config)
    x, pos = torch.zeros(1, 4, 64), torch.tensor([[0, 7, 900, 4000]])
    got = Eagle3Drafter(spec).rotary_emb(x, pos)
    for ref_cfg in (LlamaConfig(**target), LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})):
        ref = LlamaRotaryEmbedding(ref_cfg)(x, pos)
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])


def test_text_config_nesting_keeps_the_outer_architecture():
    wrapped = {"model_type": "some_vlm", "architectures": ["SomeVLMForConditionalGeneration"],
               "text_config": {**BASE, "model_type": "qwen3"}, "vision_config": {"hidden_size": 32}}
    fam, shape = read_target(wrapped)
    assert fam.name == "qwen3" and shape.hidden_size == 64
    config = serving_config(wrapped, DCFG, [2, 4, 5], 128, fmt="speculators", target_name="org/vlm")
    assert config["speculators_config"]["verifier"]["architectures"] == ["SomeVLMForConditionalGeneration"]


def test_mtp_layers_do_not_count(register):
    """DeepSeek-V3 style: num_hidden_layers (61) excludes the MTP module, stored as layer 61 in the weights."""
    register(TargetFamily("mtp_test", ("mtp_test",)))
    target = {**BASE, "model_type": "mtp_test", "num_hidden_layers": 61, "num_nextn_predict_layers": 1}
    shape = read_target(target)[1]
    assert shape.num_hidden_layers == 61 and shape.mtp_layers == 1
    spec, config = _spec_and_config(target, ids=(2, 30, 58))
    assert spec.target_num_hidden_layers == 61
    with pytest.raises(ValueError, match=r"\[1, 60\]"):
        serving_config(target, DCFG, [2, 30, 61], 128)


def test_family_layer_kind_must_be_registered(register):
    register(TargetFamily("odd_test", ("odd_test",), layer_kind="rwkv"))
    with pytest.raises(ValueError, match="layer kind 'rwkv'.*models/layers/"):
        DrafterSpec.from_target_config({**BASE, "model_type": "odd_test"}, DCFG, [2, 4, 5])


# ---- a registered family is used end to end --------------------------------------------------------

FAKE = {"model_type": "fake_decoder", "architectures": ["FakeDecoderForCausalLM"], "d_model": 64, "ffn_dim": 96,
        "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "n_positions": 4096, "norm_eps": 1e-5, "vocab_size": 512,
        "rope_theta": 50000.0}


def _read_fake(d):
    """A family whose config spells the Llama fields its own way: only its reader can make sense of it."""
    return read_decoder_config({"model_type": d["model_type"], "architectures": d["architectures"],
                                "hidden_size": d["d_model"], "intermediate_size": d["ffn_dim"],
                                "num_hidden_layers": d["n_layers"], "num_attention_heads": d["n_heads"],
                                "num_key_value_heads": d["n_kv_heads"], "max_position_embeddings": d["n_positions"],
                                "rms_norm_eps": d["norm_eps"], "vocab_size": d["vocab_size"],
                                "rope_theta": d["rope_theta"]})


def test_registered_family_shapes_drafter_export_lint_and_load(register, tmp_path):
    with pytest.raises(ValueError, match="fake_decoder"):
        read_target(FAKE)
    register(TargetFamily("fake", ("fake_decoder",), read=_read_fake))
    spec = DrafterSpec.from_target_config(FAKE, DCFG, [2, 4, 5])
    assert (spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads, spec.head_dim) == (64, 96, 2, 16)
    assert spec.rope["rope_theta"] == 50000.0 and spec.max_position_embeddings == 4096

    config = serving_config(FAKE, spec, [2, 4, 5], 128)
    model = Eagle3Drafter(spec)
    model.load_state_dict(random_state_dict(config))
    ckpt = DrafterCheckpoint(spec, target={"name_or_path": "t"}, step=1).write(tmp_path / "ckpt", model.state_dict())
    written = export_checkpoint(ckpt, tmp_path / "out", FAKE)
    c = layer_config(written)
    assert (c["model_type"], c["intermediate_size"], c["rope_theta"], c["max_position_embeddings"]) == \
        ("llama", 96, 50000.0, 4096)

    findings = lint_drafter(tmp_path / "out", FAKE)
    assert not has_errors(findings), format_findings(findings)
    # the linter reads the target through the family: a changed n_positions is a max-positions error
    assert "max-positions" in {f.code for f in lint_drafter(tmp_path / "out", {**FAKE, "n_positions": 8192})}

    loaded = load_drafter(tmp_path / "out", embed_weight=model.embed_tokens.weight.detach())
    assert loaded.spec == spec
    exported = read_tensors(tmp_path / "out")
    for name, t in loaded.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(t.to(exported[name].dtype), exported[name]), name


def test_deepseek_v3_family_reads_mla_widths_and_ignores_transformers_head_dim():
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512,
                           max_position_embeddings=4096, rope_parameters=rope)
    assert cfg.to_dict()["head_dim"] == 8  # transformers' head_dim of an MLA config is the RoPE width
    fam, shape = read_target(cfg)
    assert fam.name == "deepseek_v3" and shape.head_dim == 16 and shape.num_key_value_heads == 4
    assert shape.intermediate_size == 96 and shape.mtp_layers == 1  # DeepseekV3Config's default MTP count
    assert shape.mla == {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                         "v_head_dim": 16}
    assert shape.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    kimi = {**cfg.to_dict(), "model_type": "kimi_k2"}
    assert read_target(kimi)[0].name == "deepseek_v3" and read_target(kimi)[1].mla == shape.mla
    with pytest.raises(ValueError, match=r"MLA target but its config lacks \['kv_lora_rank'\]"):
        read_target({k: v for k, v in kimi.items() if k != "kv_lora_rank"})
