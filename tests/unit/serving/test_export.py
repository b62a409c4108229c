"""Export: serving layout from the target config alone (recipes llama3/qwen3), writer, loader, stage."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fledge.conf.schema import DrafterConfig
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.models.families import rope_of
from fledge.models.weights import read_tensors
from fledge.pipeline.runner import StageContext
from fledge.pipeline.stages import export as run_stage, export_inputs
from fledge.run_layout import RunLayout
from fledge.serving.export import from_serving_state_dict, to_serving_state_dict, write_drafter
from fledge.serving.lint import compose_recipe, has_errors, lint_drafter
from fledge.serving.serving_config import expected_tensors, serving_config
from tests.helpers.models import random_state_dict

TINY_TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "vocab_size": 512,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 1024},
}
TINY_SPEC = {"fc_norm": True, "norm_output": True, "norm_before_fc": False, "aux_layer_ids": [2, 4, 5],
             "draft_vocab_size": 128, "vocab_size": 512, "hidden_size": 64}


def _recipe_export(recipe, fmt="hf"):
    cfg = compose_recipe(recipe)
    config = serving_config(cfg.target.config_overrides, cfg.drafter, cfg.aux_layer_ids(),
                            cfg.drafter.draft_vocab_size, fmt=fmt, target_name=cfg.target.name_or_path)
    return cfg, config


@pytest.mark.parametrize("recipe,ids,theta,scaling_type,max_pos,eps,inter,V", [
    ("llama3", [2, 16, 29], 500000.0, "llama3", 131072, 1e-5, 14336, 128256),
    ("qwen3", [2, 18, 33], 1000000.0, None, 40960, 1e-6, 12288, 151936),
])
def test_recipe_serving_config_matches_spec(recipe, ids, theta, scaling_type, max_pos, eps, inter, V):
    cfg, c = _recipe_export(recipe)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False and c["torch_dtype"] == "bfloat16"
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4096, 32, 8, 128)
    assert c["intermediate_size"] == inter and c["hidden_act"] == "silu" and c["rms_norm_eps"] == eps
    assert c["rope_theta"] == theta and c["max_position_embeddings"] == max_pos
    if scaling_type is None:
        assert c["rope_scaling"] is None
    else:  # every field of the target's rope_scaling copied, not just the type
        assert c["rope_scaling"] == cfg.target.config_overrides["rope_scaling"]
    assert c["vocab_size"] == V and c["draft_vocab_size"] == 32000 and "target_hidden_size" not in c
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert c["fc_norm"] is True and c["norm_output"] is True and "norm_before_fc" not in c
    # transformers (5) reads the same RoPE back from the written keys
    from transformers import LlamaConfig

    rp = LlamaConfig(**{k: v for k, v in c.items() if k != "architectures"}).rope_parameters
    assert rp["rope_theta"] == theta and rp["rope_type"] == (scaling_type or "default")
    assert rope_of(c) == rope_of(cfg.target.config_overrides)

    shapes = {k: s for k, (s, _) in expected_tensors(c).items()}
    H, Vd = 4096, 32000
    want = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,),
            **{f"fc_norm.{i}.weight": (H,) for i in range(3)},
            **{f"midlayer.{n}.weight": (H,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
            "midlayer.self_attn.q_proj.weight": (4096, 2 * H), "midlayer.self_attn.k_proj.weight": (1024, 2 * H),
            "midlayer.self_attn.v_proj.weight": (1024, 2 * H), "midlayer.self_attn.o_proj.weight": (H, 4096),
            "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
            "midlayer.mlp.down_proj.weight": (H, inter)}
    assert shapes == want
    dtypes = {k: t for k, (_, t) in expected_tensors(c).items()}
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool and dtypes["fc.weight"] == torch.bfloat16


def test_eagle3_flags_and_speculators_dialect():
    cfg = compose_recipe("llama3", ["drafter=eagle3"])
    c = serving_config(cfg.target.config_overrides, cfg.drafter, cfg.aux_layer_ids(), 32000)
    assert c["fc_norm"] is False and c["norm_output"] is False
    assert not any(k.startswith("fc_norm.") for k in expected_tensors(c))

    cfg, s = _recipe_export("llama3", fmt="speculators")
    assert s["speculators_model_type"] == "eagle3" and s["architectures"] == ["Eagle3Speculator"]
    assert s["norm_before_residual"] is False  # vLLM's adapter defaults a missing key to true
    assert s["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert s["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert s["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29] and s["draft_vocab_size"] == 32000
    layer = s["transformer_layer_config"]
    assert layer["rope_scaling"]["rope_type"] == "llama3" and layer["max_position_embeddings"] == 131072
    assert layer["fc_norm"] is True and layer["norm_output"] is True
    names = set(expected_tensors(s))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)


def test_serving_config_rejects_bad_ids_and_transformers5_rope():
    with pytest.raises(ValueError, match="starts with 1"):
        serving_config(TINY_TARGET, TINY_SPEC, [1, 4, 5], 128)
    with pytest.raises(ValueError, match=r"\[1, 7\]"):
        serving_config(TINY_TARGET, TINY_SPEC, [2, 4, 8], 128)
    with pytest.raises(ValueError, match="norm_before_fc"):
        serving_config(TINY_TARGET, {**TINY_SPEC, "norm_before_fc": True}, [2, 4, 5], 128)
    # a transformers-5 config object stores RoPE in rope_parameters only: still exported at the top level
    from transformers import LlamaConfig

    t5 = LlamaConfig(**{k: v for k, v in copy.deepcopy(TINY_TARGET).items() if k != "architectures"})
    c = serving_config(t5, TINY_SPEC, [2, 4, 5], 128)
    assert c["rope_theta"] == 500000.0 and c["rope_scaling"]["rope_type"] == "llama3"
    assert c["rope_scaling"]["factor"] == 8.0 and c["max_position_embeddings"] == 4096


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_writer_shards_and_round_trips_tensors(tmp_path, fmt):
    config = serving_config(TINY_TARGET, TINY_SPEC, [2, 4, 5], 128, fmt=fmt, target_name="tiny")
    sd = random_state_dict(config)
    out = write_drafter(tmp_path / "drafter", sd, config, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    assert not list(tmp_path.glob(".drafter*"))  # temp dir renamed away
    tensors = read_tensors(out)
    assert "embed_tokens.weight" not in tensors  # engines share the target's embedding
    assert set(tensors) == set(expected_tensors(config))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in ("d2t", "t2d"))
    back = from_serving_state_dict(tensors)
    for name, t in back.items():
        ref = sd[name]
        assert torch.equal(t, ref.to(torch.bfloat16).to(t.dtype)) if t.is_floating_point() else torch.equal(t, ref)
    assert not has_errors(lint_drafter(out, TINY_TARGET))


def test_serving_adapters_are_inverse():
    sd = {"midlayer.mlp.up_proj.weight": torch.randn(3, 2), "d2t": torch.tensor([0, 1]), "fc.weight": torch.randn(2, 6)}
    spec = to_serving_state_dict(sd, "speculators")
    assert "layers.0.mlp.up_proj.weight" in spec and spec["d2t"].dtype == torch.int64
    assert set(from_serving_state_dict(spec)) == set(sd)


class _World:
    rank, world_size, is_main = 0, 1, True

    def barrier(self):
        pass


def _ctx(cfg, run_dir, upstream) -> StageContext:
    return StageContext(export_inputs(cfg), _World(), RunLayout(run_dir), "export", upstream)


def _checkpoint(path: Path, config: dict, trained: DrafterCheckpoint) -> Path:
    return trained.write(path, random_state_dict(config))


def test_export_stage_writes_lints_and_summarises(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(TINY_TARGET))
    cfg = compose_recipe("tiny", [f"target.name_or_path={target_dir}", "target.num_hidden_layers=8",
                                  "drafter.draft_vocab_size=128"])
    spec = DrafterSpec.from_target_config(TINY_TARGET, DrafterConfig(draft_vocab_size=128), [2, 4, 5])
    config = serving_config(TINY_TARGET, spec, [2, 4, 5], 128)
    ckpt = _checkpoint(tmp_path / "run" / "train" / "best", config, DrafterCheckpoint(
        spec, target={"name_or_path": str(target_dir), "revision": None}, step=7, metrics={"acc_0": 0.5}))
    ctx = _ctx(cfg, tmp_path / "run", {"train": {"outputs": {"best": str(ckpt), "last": str(ckpt),
                                                             "best_al_estimate": None}}})
    summary = run_stage(ctx)
    out = Path(summary["drafter"])
    assert summary["lint_errors"] == 0 and "config.json" in summary["files"]
    written = json.loads((out / "config.json").read_text())
    assert written == config
    record = json.loads((out / RECORD).read_text())
    assert record["trained_with"]["norm_output"] is True and record["step"] == 7
    # the config follows how the checkpoint was trained (spec), not the current drafter config
    bad_spec = dataclasses.replace(spec, norm_output=False)
    ckpt2 = _checkpoint(tmp_path / "run" / "train" / "bad", config, DrafterCheckpoint(bad_spec, step=1))
    ctx.inputs.export.checkpoint = str(ckpt2)
    summary2 = run_stage(ctx)
    assert json.loads((Path(summary2["drafter"]) / "config.json").read_text())["norm_output"] is False


# ---- round trip through the real drafter (models/drafter.py) ----------------------------------------

def _trained_like_drafter(fc_norm=True, norm_output=True, seed=0):
    from fledge.conf.schema import DrafterConfig
    from fledge.models.algorithms import DrafterSpec
    from fledge.models.drafter import Eagle3Drafter

    dcfg = DrafterConfig(fc_norm=fc_norm, norm_output=norm_output, draft_vocab_size=128)
    spec = DrafterSpec.from_target_config(copy.deepcopy(TINY_TARGET), dcfg, [2, 4, 5])
    torch.manual_seed(seed)
    model = Eagle3Drafter(spec, attention="sdpa")
    sd = random_state_dict(serving_config(TINY_TARGET, spec, [2, 4, 5], 128), seed=seed)
    model.load_state_dict(sd)  # random norms/maps too, so a dropped or misplaced tensor changes the logits
    return spec, model


def _logits(model, steps=3):
    """Engine-style chain: prefill on fused aux states, then fed-back drafts (exercises norm_output)."""
    from fledge.models.drafter import DraftCache

    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 6, 3 * 64, generator=g)
    ids = torch.randint(0, 512, (1, 6), generator=g)
    pos = torch.arange(6)[None]
    cache, outs = DraftCache(), []
    with torch.no_grad():
        logits, h = model.decode_step(ids, model.fuse(aux), pos, cache)
        outs.append(logits)
        for i in range(1, steps):
            tok = model.draft_to_target(logits[:, -1:].argmax(-1))
            logits, h = model.decode_step(tok, h[:, -1:], pos[:, -1:] + i, cache)
            outs.append(logits)
    return torch.cat(outs, 1)


def _bf16_copy(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n != "embed_tokens.weight":  # the embedding comes back from the target, unrounded
                p.copy_(p.to(torch.bfloat16).float())
    return m


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_export_load_reproduces_training_logits(tmp_path, fmt):
    from fledge.serving.export import export_checkpoint, load_drafter

    spec, model = _trained_like_drafter()
    ckpt = DrafterCheckpoint(spec, target={"name_or_path": "tiny", "revision": None}, step=3).write(
        tmp_path / "ckpt", model.state_dict())
    export_checkpoint(ckpt, tmp_path / "out", TINY_TARGET, fmt=fmt, max_shard_size="64KB")
    assert not has_errors(lint_drafter(tmp_path / "out", TINY_TARGET))
    loaded = load_drafter(tmp_path / "out", embed_weight=model.embed_tokens.weight.detach())
    loaded.attention = "sdpa"
    assert loaded.spec == spec
    torch.testing.assert_close(_logits(loaded), _logits(_bf16_copy(model)), rtol=1e-5, atol=1e-5)
    # and close to the fp32 training model (bf16 weight rounding only)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0.05, atol=0.05)


def test_loader_imports_public_eagle3_layout(tmp_path):
    """A public EAGLE-3 checkpoint: HF layout, no fc_norm, no embed_tokens, no t2d, no training record;
    the embedding comes from the target's own safetensors."""
    from fledge.serving.export import load_drafter

    spec, model = _trained_like_drafter(fc_norm=False, norm_output=False, seed=3)
    config = serving_config(TINY_TARGET, spec, [2, 4, 5], 128)
    tensors = {k: v for k, v in to_serving_state_dict(model.state_dict()).items() if k != "t2d"}
    out = tmp_path / "public"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY_TARGET))
    save_file({"model.embed_tokens.weight": model.embed_tokens.weight.detach().clone()},
              str(target / "model.safetensors"))
    loaded = load_drafter(out, target=target)
    loaded.attention = "sdpa"
    assert not loaded.spec.fc_norm and not loaded.spec.norm_output
    assert torch.equal(loaded.t2d, model.t2d)
    torch.testing.assert_close(_logits(loaded), _logits(_bf16_copy(model)), rtol=1e-5, atol=1e-5)


def test_a_parallel_drafter_exports_its_mask_and_lints_and_serves_with_parallel_drafting(tmp_path):
    """P-EAGLE: config.json names mask_token_id (vLLM's parallel-slot token) and the weights carry mask_hidden
    [1, n*Ht]; loaded back as served, it is a parallel drafter with that state; the engine is asked for
    parallel_drafting; an export that drops the token is refused by the linter."""
    from fledge.models.drafter import Eagle3Drafter
    from fledge.serving.engine import speculative_config
    from fledge.serving.export import export_checkpoint, load_drafter

    target = {**TINY_TARGET, "pad_token_id": 0}
    spec = DrafterSpec.from_target_config(copy.deepcopy(target), DrafterConfig(draft_vocab_size=128,
                                                                               parallel_drafting=True), [2, 4, 5])
    assert spec.parallel_drafting and spec.mask_token_id == 0
    torch.manual_seed(0)
    model = Eagle3Drafter(spec, attention="sdpa")
    ckpt = DrafterCheckpoint(spec, target={"name_or_path": "tiny", "revision": None}, step=3).write(
        tmp_path / "ckpt", model.state_dict())
    out = tmp_path / "out"
    export_checkpoint(ckpt, out, target, fmt="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 0
    assert tuple(read_tensors(out)["mask_hidden"].shape) == (1, 3 * 64)
    assert not has_errors(lint_drafter(out, target))
    assert speculative_config("eagle3", 5, out).get("parallel_drafting") is True
    loaded = load_drafter(out, embed_weight=model.embed_tokens.weight.detach(), serving=True)
    assert loaded.spec.parallel_drafting and loaded.spec.mask_token_id == 0
    torch.testing.assert_close(loaded.mask_hidden, model.mask_hidden.detach().to(torch.bfloat16).float())
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    codes = {f.code for f in lint_drafter(out, target) if f.level == "error"}
    assert "parallel-drafting-mismatch" in codes, codes
    assert "parallel_drafting" not in speculative_config("eagle3", 5, out)
