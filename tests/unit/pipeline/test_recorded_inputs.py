"""Existing run directories keep resuming: what each stage hashes is what the manifests of earlier Fledges hold.

tests/fixtures/stage_inputs/ was recorded by the Fledge before the typed stage inputs (commit 87a3ec4, whose
stages declared dotted config keys): ``hashes.json`` holds, for several configs, every stage's manifest
``inputs`` and ``inputs_hash``; ``tiny_run/`` is a run directory its runner wrote (recipe=tiny, all six stages,
stand-in work). Never re-record them: a hash that moves is a run directory that stops resuming. A change that
must move one goes through the runner's upgrade rules (pipeline/runner.py ``_only_an_upgrade``) and a new test.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers

from fledge.conf import compose
from fledge.distributed import init_world
from fledge.pipeline import runner
from fledge.pipeline.stages import PIPELINE
from tests.helpers.paths import REPO

FIXTURES = REPO / "tests" / "fixtures" / "stage_inputs"
RECORDED = json.loads((FIXTURES / "hashes.json").read_text())
ALL_STAGES = "run.stages=[prepare,capture,train,export,eval,publish]"


def _as_recorded(payload: dict, recorded: dict) -> dict:
    """``payload`` with what the recording machine's environment set: library versions, a local target's mtimes."""
    payload = json.loads(json.dumps(payload, default=str))
    payload["versions"] = recorded["versions"]
    if "target_fingerprint" in payload:
        payload["target_fingerprint"] = recorded["target_fingerprint"]
    return payload


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_stage_hashes_what_an_earlier_fledge_recorded(name, tmp_path):
    """tiny, smollm2, capture online (hf, vllm), offline vllm, DFlash, a changed cadence and layout (runtime: the
    same hashes as tiny), publishing: per stage, the config it hashes and the hash, chained through upstream."""
    cfg = compose([*RECORDED[name]["overrides"], ALL_STAGES, f"run.output_root={tmp_path}"])
    recorded = RECORDED[name]["stages"]
    upstream: dict[str, str] = {}
    for stage in PIPELINE:
        was = recorded[stage.name]
        payload = _as_recorded(runner.stage_inputs(cfg, stage, upstream), was["inputs"])
        assert payload["config"] == was["inputs"]["config"], stage.name
        assert payload == was["inputs"], stage.name
        assert runner.digest(payload) == was["inputs_hash"], stage.name
        upstream[stage.name] = was["inputs_hash"]


def test_a_run_directory_of_the_recorded_format_is_up_to_date(tmp_path, monkeypatch):
    """The recorded run, planned again with its own config (in the library versions it recorded): every stage is
    up to date, nothing runs and no manifest is rewritten."""
    shutil.copytree(FIXTURES / "tiny_run", tmp_path / "tiny", ignore=shutil.ignore_patterns("overrides.json"))
    overrides = json.loads((FIXTURES / "tiny_run" / "overrides.json").read_text())
    versions = json.loads((FIXTURES / "tiny_run" / "prepare" / "manifest.json").read_text())["inputs"]["versions"]
    monkeypatch.setattr(torch, "__version__", versions["torch"])
    monkeypatch.setattr(transformers, "__version__", versions["transformers"])
    before = {s.name: (tmp_path / "tiny" / s.name / "manifest.json").read_text() for s in PIPELINE}

    def must_not_run(ctx):
        raise AssertionError(f"stage {ctx.stage} ran: its recorded manifest is no longer up to date")

    stages = [replace(s, run=must_not_run) for s in PIPELINE]
    result = runner.run_stages(compose([*overrides, f"run.output_root={tmp_path}"]), init_world(), stages)
    assert {name: m["action"] for name, m in result.items()} == {s.name: "skip" for s in PIPELINE}
    assert {s.name: (tmp_path / "tiny" / s.name / "manifest.json").read_text() for s in PIPELINE} == before
