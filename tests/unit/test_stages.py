"""The stage runner: skip by manifest, resume an interrupted stage, re-run on changed inputs."""

import json

import pytest
import fledge.train.runner as runner
from fledge.conf import compose
from fledge.conf.schema import STAGES
from fledge.distributed import init_world


def make_cfg(tmp_path, *overrides):
    # the target must exist (the runner checks it first); these stages never read it
    return compose(["recipe=tiny", f"run.output_root={tmp_path}", f"target.name_or_path={tmp_path}", *overrides])


class _Calls(list):
    kill: list
    fns: dict
    partial: list


@pytest.fixture
def calls(monkeypatch):
    log = _Calls()
    kill = []
    log_kill = kill

    def entry_for(stage):
        def run(ctx):
            log.append(stage)
            (ctx.stage_dir / "out.txt").write_text(stage)
            if stage == "capture" and kill:
                kill.pop()
                raise KeyboardInterrupt  # simulated kill mid-stage, partial output left behind
            if stage == "capture" and log.partial:
                log.partial.pop()
                return {"n": len(log), "complete": False}  # e.g. one slice of an array capture
            return {"n": len(log)}
        return run

    log.fns = {stage: entry_for(stage) for stage in STAGES}
    log.kill = log_kill
    log.partial = []
    return log


@pytest.fixture(scope="module")
def world():
    return init_world()


def test_runs_in_order_then_skips(tmp_path, calls, world):
    cfg = make_cfg(tmp_path, "run.stages=[prepare,capture,train]")
    runner.run_stages(cfg, world, calls.fns)
    assert calls == ["prepare", "capture", "train"]
    m = json.loads((tmp_path / "tiny" / "capture" / "manifest.json").read_text())
    assert m["complete"] and m["outputs"] == {"n": 2}
    runner.run_stages(cfg, world, calls.fns)
    assert calls == ["prepare", "capture", "train"]  # all up to date


def test_changed_input_reruns_that_stage_and_later(tmp_path, calls, world):
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]"), world, calls.fns)
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]", "capture.dtype=fp8"), world, calls.fns)
    assert calls == ["capture", "train"]
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]", "capture.dtype=fp8",
                               "train.optim.lr=0.5"), world, calls.fns)
    assert calls == ["train"]


def test_interrupted_stage_runs_again(tmp_path, calls, world):
    calls.kill.append(True)
    with pytest.raises(KeyboardInterrupt):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world, calls.fns)
    m = json.loads((tmp_path / "tiny" / "capture" / "manifest.json").read_text())
    assert m["complete"] is False
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world, calls.fns)
    assert calls == ["capture"]  # same inputs, incomplete: runs again over its partial output
    assert (tmp_path / "tiny" / "capture" / "out.txt").exists()


def test_missing_upstream_is_a_clear_error(tmp_path, calls, world):
    with pytest.raises(ValueError, match="needs the output of 'prepare'"):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[capture]"), world, calls.fns)


def test_force_reruns(tmp_path, calls, world):
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare]"), world, calls.fns)
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare]", "run.force=[prepare]"), world, calls.fns)
    assert calls == ["prepare", "prepare"]


def test_partial_stage_stays_incomplete_and_stops_the_run(tmp_path, calls, world):
    calls.partial.append(True)
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]"), world, calls.fns)
    assert calls == ["prepare", "capture"]  # train did not run after a partial capture
    m = json.loads((tmp_path / "tiny" / "capture" / "manifest.json").read_text())
    assert m["complete"] is False and m["partial"] is True and m["outputs"] == {"n": 2}
    assert not (tmp_path / "tiny" / "train").exists()
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]"), world, calls.fns)
    assert calls == ["capture", "train"]  # same hash, incomplete: capture runs again (the merge), then train
    assert (tmp_path / "tiny" / "capture" / "out.txt").exists()  # not cleared


def test_capture_slices_share_the_stage_hash(tmp_path, calls, world):
    plain = make_cfg(tmp_path, "run.stages=[prepare,capture,train]")
    task = make_cfg(tmp_path, "run.stages=[capture]", "capture.num_slices=4", "capture.slice_index=3")
    merge = make_cfg(tmp_path, "run.stages=[prepare,capture,train]", "capture.num_slices=4")
    hashes = {runner.inputs_hash(c, "capture", {}) for c in (plain, task, merge)}
    assert len(hashes) == 1
    assert runner.inputs_hash(make_cfg(tmp_path, "capture.batch_tokens=7"), "capture", {}) not in hashes
    runner.run_stages(plain, world, calls.fns)
    calls.clear()
    runner.run_stages(merge, world, calls.fns)
    assert calls == []  # a complete store is not captured again because the job asks for slices


@pytest.mark.parametrize("overrides,match", [
    (["capture.num_slices=0"], "capture.num_slices=0"),
    (["run.stages=[capture]", "capture.num_slices=2", "capture.slice_index=2"], r"must be in \[0"),
    (["capture.num_slices=2", "capture.slice_index=0"], r"run.stages=\[capture\]"),  # never prepare in a task
    (["run.stages=[capture]", "run.force=[capture]", "capture.num_slices=2", "capture.slice_index=0"], "clear"),
    (["run.force=[capture]", "capture.num_slices=2"], "clear the slices"),  # the merge must not wipe them
])
def test_bad_slice_settings_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(tmp_path, *overrides)


def test_export_reruns_when_what_it_reads_changes(tmp_path, calls, world):
    """Export writes the target's config (target.config_overrides when the target has no local config.json)
    and the draft length into config.json: changing either re-runs export (and eval), nothing before it."""
    stages = "run.stages=[prepare,capture,train,export,eval]"
    runner.run_stages(make_cfg(tmp_path, stages), world, calls.fns)
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, stages, "+target.config_overrides.rms_norm_eps=1e-6"), world, calls.fns)
    assert calls == ["export", "eval"]
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, stages, "+target.config_overrides.rms_norm_eps=1e-6", "eval.draft_tokens=4"),
                      world, calls.fns)
    assert calls == ["export", "eval"]
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, stages, "+target.config_overrides.rms_norm_eps=1e-6", "eval.draft_tokens=4"),
                      world, calls.fns)
    assert calls == []
