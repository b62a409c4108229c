"""The stage runner: skip by manifest, resume an interrupted stage, re-run on changed inputs."""

import json

import pytest
from hydra import compose, initialize_config_dir

import train.main  # noqa: F401
import train.stages as stages
from train.distributed import init_world
from train.main import CONF_DIR, to_config


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        d = compose(config_name="config", overrides=["recipe=tiny", f"run.output_root={tmp_path}", *overrides])
    return to_config(d)


class _Calls(list):
    kill: list


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
            return {"n": len(log)}
        return run

    monkeypatch.setattr(stages, "load_entry", entry_for)
    log.kill = log_kill
    return log


@pytest.fixture(scope="module")
def world():
    return init_world()


def test_runs_in_order_then_skips(tmp_path, calls, world):
    cfg = make_cfg(tmp_path, "run.stages=[prepare,capture,train]")
    stages.run_stages(cfg, world)
    assert calls == ["prepare", "capture", "train"]
    m = json.loads((tmp_path / "tiny" / "capture" / "manifest.json").read_text())
    assert m["complete"] and m["outputs"] == {"n": 2}
    stages.run_stages(cfg, world)
    assert calls == ["prepare", "capture", "train"]  # all up to date


def test_changed_input_reruns_that_stage_and_later(tmp_path, calls, world):
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]"), world)
    calls.clear()
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]", "capture.dtype=fp8"), world)
    assert calls == ["capture", "train"]
    calls.clear()
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train]", "capture.dtype=fp8",
                               "train.optim.lr=0.5"), world)
    assert calls == ["train"]


def test_interrupted_stage_runs_again(tmp_path, calls, world):
    calls.kill.append(True)
    with pytest.raises(KeyboardInterrupt):
        stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world)
    m = json.loads((tmp_path / "tiny" / "capture" / "manifest.json").read_text())
    assert m["complete"] is False
    calls.clear()
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world)
    assert calls == ["capture"]  # same inputs, incomplete: runs again over its partial output
    assert (tmp_path / "tiny" / "capture" / "out.txt").exists()


def test_missing_upstream_is_a_clear_error(tmp_path, calls, world):
    with pytest.raises(ValueError, match="needs the output of 'prepare'"):
        stages.run_stages(make_cfg(tmp_path, "run.stages=[capture]"), world)


def test_force_reruns(tmp_path, calls, world):
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare]"), world)
    stages.run_stages(make_cfg(tmp_path, "run.stages=[prepare]", "run.force=[prepare]"), world)
    assert calls == ["prepare", "prepare"]


def test_unbuilt_stage_fails_clearly(monkeypatch):
    monkeypatch.setitem(stages.STAGE_ENTRY, "eval", "models.no_such_module:run_stage")
    with pytest.raises(NotImplementedError, match="stage 'eval' is not built yet"):
        stages.load_entry("eval")
