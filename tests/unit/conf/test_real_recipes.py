"""The recipes for real MoE / MLA targets (qwen3_moe, deepseek_v3, kimi_k2) compose, and their drafters'
serving exports lint clean against the published config of their target (the checked-in snapshot
recipes/<name>/target_config.json), offline.

A full-size export (a 7168-wide drafter is ~1.5 GB) is written as a *sparse* safetensors file: real headers
and real d2t/t2d, the weights' bytes left as holes, so the linter reads exactly what it reads from a real
export at no disk or memory cost.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from fledge.models.families import read_target, text_config_dict
from fledge.serving.lint import compose_recipe, format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import expected_tensors, serving_config
from tests.helpers.paths import REPO as ROOT

RECIPES = {  # recipe: (family, drafter intermediate_size, drafter head_dim, aux ids)
    "qwen3_moe": ("qwen3_moe", 6144, 128, [2, 24, 45]),
    "deepseek_v3": ("deepseek_v3", 18432, 56, [2, 30, 58]),
    "kimi_k2": ("deepseek_v3", 18432, 112, [2, 30, 58]),
}
_ST = {torch.bfloat16: ("BF16", 2), torch.float32: ("F32", 4), torch.int64: ("I64", 8), torch.bool: ("BOOL", 1)}


def snapshot(recipe: str) -> dict:
    return {k: v for k, v in json.loads((ROOT / "recipes" / recipe / "target_config.json").read_text()).items()
            if not k.startswith("_")}


def write_sparse_export(out: Path, config: dict, seed: int = 0) -> Path:
    """config.json + model.safetensors whose float tensors are holes; d2t / t2d hold a valid random map."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    V, Vd = int(config["vocab_size"]), int(config["draft_vocab_size"])
    sel = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    real = {"d2t": (sel - torch.arange(Vd)).numpy().tobytes(), "t2d": t2d.numpy().tobytes()}
    specs = expected_tensors(config)
    names = ["d2t", "t2d"] + sorted(n for n in specs if n not in real)  # the real bytes first, holes after
    header, offset = {}, 0
    for n in names:
        shape, dtype = specs[n]
        tag, size = _ST[dtype]
        nbytes = size * int(torch.Size(shape).numel())
        header[n] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + real["d2t"] + real["t2d"])
        f.truncate(8 + len(blob) + offset)
    return out


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_fields_match_the_published_config(recipe):
    cfg = compose_recipe(recipe)
    snap = snapshot(recipe)
    written = dict(cfg.target.config_overrides)
    assert {k: written.get(k) for k in snap} == snap, "conf/target disagrees with the checked-in snapshot"
    assert (cfg.target.num_hidden_layers, cfg.target.hidden_size, cfg.target.vocab_size) == (
        snap["num_hidden_layers"], snap["hidden_size"], snap["vocab_size"])
    family, inter, head_dim, ids = RECIPES[recipe]
    fam, shape = read_target(snap)
    assert fam.name == family
    assert shape.intermediate_size == inter != snap["moe_intermediate_size"]  # the dense width, not an expert's
    assert shape.head_dim == head_dim
    assert cfg.aux_layer_ids() == ids and max(ids) < snap["num_hidden_layers"]  # MTP layers never counted
    if family == "deepseek_v3":
        assert shape.mla == {k: snap[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                  "qk_rope_head_dim", "v_head_dim")}
        assert shape.rope_scaling["rope_type"] == "yarn" and shape.rope_scaling["mscale_all_dim"] == 1.0


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = {}
    for recipe in RECIPES:
        cfg = compose_recipe(recipe)
        config = serving_config(cfg.target.config_overrides, cfg.drafter, cfg.aux_layer_ids(),
                                cfg.drafter.draft_vocab_size, target_name=cfg.target.name_or_path)
        out[recipe] = write_sparse_export(tmp_path_factory.mktemp(recipe) / "drafter", config)
    return out


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_export_lints_clean_against_the_published_config(recipe, exports):
    d = exports[recipe]
    findings = lint_drafter(d, snapshot(recipe))
    assert not has_errors(findings), format_findings(findings)
    c = json.loads((d / "config.json").read_text())
    snap = snapshot(recipe)
    assert c["vocab_size"] == snap["vocab_size"] and c["max_position_embeddings"] == snap["max_position_embeddings"]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == RECIPES[recipe][3]
    assert (d / "model.safetensors").stat().st_blocks * 512 < 16 << 20  # sparse: the holes take no disk


@pytest.mark.parametrize("recipe,field,value", [
    ("kimi_k2", "rope_scaling", {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("deepseek_v3", "rope_theta", 50000.0),
    ("qwen3_moe", "rms_norm_eps", 1e-5),
])
def test_a_target_that_differs_from_the_recipe_fails_the_lint(recipe, field, value, exports):
    """Negative control: the same export against a config that differs in one field the drafter copies."""
    other = {**snapshot(recipe), field: value}
    assert has_errors(lint_drafter(exports[recipe], other))


def test_kimi_k26_nested_text_config_reads_as_the_same_shape():
    snap = snapshot("kimi_k2")
    k26 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": snap, "vision_config": {"hidden_size": 1152}}
    assert read_target(k26)[1] == read_target(snap)[1]
    assert text_config_dict(k26)["model_type"] == "kimi_k2"


@pytest.mark.parametrize("recipe,device,backend", [("deepseek_v3", "cpu", "CPU_MLA"), ("kimi_k2", "cpu", "CPU_MLA"),
                                                   ("deepseek_v3", "cuda", None), ("qwen3_moe", "cpu", None)])
def test_engine_attention_backend_for_mla_targets_on_cpu(recipe, device, backend):
    """vLLM picks AMX_MLA (bf16 only) for MLA targets on an AMX CPU; the fp32 CPU engine asks for CPU_MLA."""
    from fledge.evaluation.engine_eval import engine_attention_backend

    assert engine_attention_backend(compose_recipe(recipe).target, device) == backend
