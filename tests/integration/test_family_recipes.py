"""recipe=tiny_moe and recipe=tiny_mla end to end through the README's main command (torchrun, 2 gloo ranks) on
the project's own tiny Qwen3-MoE-shaped and DeepSeek-V3-shaped targets (testbed/tiny_families.py), checked against
recipes/tiny_<family>/golden.json. tests/engine/test_vllm_families.py checks what vLLM made of the same runs.

These targets are built on the machine that tests them, and the build is not the same model on every CPU: the
MoE router's top-2 choices are discrete, so fp32 kernels that sum in another order (AVX2, AVX-512, AMX) flip
experts and training goes elsewhere from there (an earlier MLA target built with AVX2 kernels greedily wrote one
token outside the draft vocabulary). golden.json records what was measured. No figure of these runs
is held to one golden value: the tests hold what does not depend on the target's trajectory (every stage,
lossless greedy output, a clean lint, the export is the drafter that was trained, and the drafter learned: its
held-out estimate above a floor well below the measurement and far above an untrained drafter's ~1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fledge.evaluation.engine_eval import export_estimate
from tests.helpers.paths import REPO as ROOT

# The MoE and MLA targets that write cost ~10 CPU-minutes to build beside the suite, past CI's 30 minutes on 2 cores:
# these runs are the full suite's (FLEDGE_ENGINE_FULL=1 scripts/test.sh), tests/unit/testbed/test_tiny_families.py
# takes both shapes through capture, export and lint in CI.
pytestmark = pytest.mark.skipif(os.environ.get("FLEDGE_ENGINE_FULL") != "1",
                                reason="the tiny family runs are the full suite's: FLEDGE_ENGINE_FULL=1")


FAMILIES = {
    # family: (architecture the hf dialect writes, the layer-specific config keys vLLM reads)
    "moe": ("LlamaForCausalLMEagle3", {"head_dim": 32}),
    "mla": ("Eagle3DeepseekV2ForCausalLM", {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
                                            "v_head_dim": 32, "q_lora_rank": 64}),
}


def golden(family: str) -> dict:
    return json.loads((ROOT / "recipes" / f"tiny_{family}" / "golden.json").read_text())


def manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_recipe_runs_end_to_end_and_its_drafter_learned(tiny_family_run, family):
    run, log = tiny_family_run(family)
    gold = golden(family)
    for stage in ("prepare", "capture", "train", "export", "eval"):
        assert manifest(run, stage)["complete"], stage
        assert f"INFO fledge: {stage}" in log
    # Teacher-forced on held-out conversations, not on the target's own loops: an untrained drafter scores ~1.
    train = manifest(run, "train")["outputs"]
    assert train["best_al_estimate"] >= gold["min_al_estimate"], train["best_al_estimate"]
    assert gold["min_al_estimate"] <= min(m["al_estimate"] for m in gold["measured"]) - 0.5  # a floor, not a golden
    rep = json.loads((run / "eval" / "report.json").read_text())
    # The export is the drafter that was trained: the eval stage's held-out estimate, through the export's
    # config.json, weights and vocab maps, is the training-time one (measured within 0.05 on every CPU kind).
    assert export_estimate(rep) == pytest.approx(train["best_al_estimate"], abs=gold["export_tolerance"])
    for name in gold["sets"]:
        s = rep["sets"][name]
        assert s["drafter"]["rounds"] > 0, name
        assert 1.0 <= s["drafter"]["al"] <= rep["k"] + 1, name
    # Lossless: the eval stage fails on a speculative greedy output that differs from plain greedy decoding
    # (evaluation/evaluate.py); its report says so for the sets it measured.
    report = (run / "eval" / "report.md").read_text()
    assert "Greedy output identical to plain greedy decoding on every prompt" in report


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_export_is_the_layer_vllm_builds_and_lints_clean(tiny_family_run, family):
    run, _ = tiny_family_run(family)
    arch, keys = FAMILIES[family]
    out = manifest(run, "export")["outputs"]
    # The export stage lints against the target's own config (RoPE, widths, aux ids, vocab maps).
    assert out["lint_errors"] == 0 and out["lint_warnings"] == 0
    drafter = Path(out["drafter"])
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    assert {k: cfg.get(k) for k in keys} == keys
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == 1024 and cfg["vocab_size"] == 2560
