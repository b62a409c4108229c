"""The stage runner: skip by manifest, resume an interrupted stage, re-run on changed inputs."""

import json
from dataclasses import replace

import pytest
import torch

import fledge.pipeline.runner as runner
import fledge.pipeline.stages as stages
import fledge.train.checkpoint as checkpoint
from fledge.conf import compose
from fledge.distributed import World, init_world


def make_cfg(tmp_path, *overrides):
    # the target must exist (the runner checks it first); these stages never read it
    return compose(["recipe=tiny", f"run.output_root={tmp_path}", f"target.name_or_path={tmp_path}", *overrides])


class _Calls(list):
    kill: list
    fns: dict
    partial: list


@pytest.fixture
def calls(monkeypatch):
    """The runner with stand-in stages: each logs its name, writes out.txt, and is planned like the real one
    (rebuild flags and train's done check from pipeline/stages.py, but no check of the input files the stand-ins
    do not read); the stand-in train reports the steps it was asked for, as the trainer does."""
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
            if stage == "train":
                t = ctx.inputs.train
                per_step = t.grad_accum * max(1, ctx.world.world_size // t.sequence_parallel)
                steps = checkpoint.planned_steps(t.max_steps, t.epochs, 0, 0, per_step, 100)
                return {"n": len(log), "steps": steps, "global_batches_per_epoch": 100,
                        "global_batches_per_step": per_step}
            return {"n": len(log)}
        return run

    log.fns = tuple(replace(stage, run=entry_for(stage.name), check=lambda inputs: None) for stage in stages.PIPELINE)
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


def test_a_changed_input_of_a_costly_stage_stops_before_anything_runs(tmp_path, calls, world):
    """A changed key of capture or train deletes nothing: one line names the key, old -> new, and the two
    ways on, before any stage runs; both ways then work."""
    three = "run.stages=[prepare,capture,train]"
    runner.run_stages(make_cfg(tmp_path, three), world, calls.fns)
    calls.clear()
    for overrides, stage, key in [(["capture.dtype=fp8"], "capture", "capture.dtype: bf16 -> fp8"),
                                  (["train.optim.lr=0.5"], "train", "train.optim.lr: 0.001 -> 0.5"),
                                  (["drafter.ttt_steps=2"], "train", "drafter.ttt_steps: 3 -> 2")]:
        with pytest.raises(ValueError) as e:
            runner.run_stages(make_cfg(tmp_path, three, *overrides), world, calls.fns)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{stage}: its inputs changed"), msg
        assert key in msg and f"run.force=[{stage}]" in msg and "new run.name" in msg, msg
        assert calls == [] and (tmp_path / "tiny" / stage / "out.txt").exists()
    runner.run_stages(make_cfg(tmp_path, three, "train.optim.lr=0.5", "run.force=[train]"), world, calls.fns)
    assert calls == ["train"]
    runner.run_stages(make_cfg(tmp_path, three, "train.optim.lr=0.5", "run.name=other"), world, calls.fns)
    assert calls == ["train", "prepare", "capture", "train"]


def test_a_forced_stage_makes_later_costly_stages_ask_to_be_forced_too(tmp_path, calls, world):
    """run.force=[capture] replaces the store train's checkpoints were trained on: train must be forced too
    (refused before capture runs); later rebuildable stages rebuild on their own."""
    five = "run.stages=[prepare,capture,train,export,eval]"
    runner.run_stages(make_cfg(tmp_path, five), world, calls.fns)
    calls.clear()
    with pytest.raises(ValueError, match=r"^train: .*capture's output: starts over in this command.*"
                                         r"run.force=\[capture,train\]"):
        runner.run_stages(make_cfg(tmp_path, five, "run.force=[capture]"), world, calls.fns)
    assert calls == []
    runner.run_stages(make_cfg(tmp_path, five, "run.force=[capture,train]"), world, calls.fns)
    assert calls == ["capture", "train", "export", "eval"]
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, five, "run.force=[export]"), world, calls.fns)
    assert calls == ["export", "eval"]  # nothing before it; eval rebuilds on the new export


def test_a_stage_run_again_earlier_makes_later_ones_out_of_date(tmp_path, calls, world):
    """capture forced in one command (prepare and capture only): the next command refuses to train on from
    checkpoints of the replaced store, and a stage that needs a stale eval says so."""
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture,train,export,eval]"), world, calls.fns)
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]", "run.force=[capture]"), world, calls.fns)
    with pytest.raises(ValueError, match=r"^train: .*capture's output: replaced since this stage ran"):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[train]"), world, calls.fns)
    with pytest.raises(ValueError, match=r"needs the output of 'eval', which is missing, incomplete or out of date"):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[publish]"), world, calls.fns)


def test_layout_keys_continue_the_run(tmp_path, calls):
    """train.sequence_parallel, grad_accum and the world size are not inputs: a run resumes at the global
    batches it consumed on any layout (the trainer warns when the step's size changes)."""
    two, one = World(0, 2, 0, torch.device("cpu")), World(0, 1, 0, torch.device("cpu"))
    three = "run.stages=[prepare,capture,train]"
    runner.run_stages(make_cfg(tmp_path, three), two, calls.fns)  # 2 data-parallel ranks x 1 micro-batch
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, three, "train.grad_accum=2"), one, calls.fns)
    runner.run_stages(make_cfg(tmp_path, three, "train.grad_accum=2", "train.sequence_parallel=2"), two, calls.fns)
    runner.run_stages(make_cfg(tmp_path, three), one, calls.fns)  # a step of 1 global batch instead of 2
    assert calls == []


def test_an_older_manifest_gets_a_message_too(tmp_path, calls, world):
    """Manifests written before they kept their inputs hold only the hash: a difference is still one line."""
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world, calls.fns)
    path = tmp_path / "tiny" / "capture" / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in m.items() if k not in ("inputs", "read", "output_id")}))
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]"), world, calls.fns)
    assert calls == []  # the same hash: up to date, as before
    with pytest.raises(ValueError,
                       match=r"^capture: .*keeps only a hash of them.*run.force=\[capture\]"):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare,capture]", "capture.dtype=fp8"), world, calls.fns)


def test_raising_the_run_length_trains_on_and_rebuilds_what_follows(tmp_path, calls, world):
    """train.max_steps is not an input: raised, train runs again over its output (its checkpoints), then
    export and eval rebuild; the same length again is up to date; lowered, one line says what was done,
    what was asked and the ways on."""
    five = "run.stages=[prepare,capture,train,export,eval]"
    runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=200"), world, calls.fns)
    calls.clear()
    (tmp_path / "tiny" / "train" / "checkpoint").write_text("step 200")
    got = runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=300"), world, calls.fns)
    assert calls == ["train", "export", "eval"]
    assert (tmp_path / "tiny" / "train" / "checkpoint").exists()  # trained on, not over
    assert got["train"]["outputs"]["steps"] == 300 and got["train"]["action"] == "resume"
    assert got["export"]["action"] == "start over" and got["prepare"]["action"] == "skip"
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=300"), world, calls.fns)
    assert calls == []
    with pytest.raises(ValueError) as e:
        runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=250"), world, calls.fns)
    msg = str(e.value)
    assert "\n" not in msg and "trained 300 steps" in msg and "train.max_steps=250 asks for 250" in msg
    assert "run.force=[train]" in msg and "new run.name" in msg
    runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=0", "train.epochs=3"), world, calls.fns)
    assert calls == []  # 3 epochs of 100 global batches, one a step: the 300 steps done
    runner.run_stages(make_cfg(tmp_path, five, "train.max_steps=0", "train.epochs=4"), world, calls.fns)
    assert calls == ["train", "export", "eval"]


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
    hashes = {runner.inputs_hash(c, stages.STAGES["capture"], {}) for c in (plain, task, merge)}
    assert len(hashes) == 1
    assert runner.inputs_hash(make_cfg(tmp_path, "capture.batch_tokens=7"), stages.STAGES["capture"], {}) not in hashes
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


def test_new_target_files_stop_too_new_library_versions_keep_the_output(tmp_path, calls, world, monkeypatch):
    import transformers

    runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare]"), world, calls.fns)
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    got = runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare]"), world, calls.fns)
    assert got["prepare"]["action"] == "skip" and got["prepare"]["inputs"]["versions"]["transformers"] == "99.0.0"
    monkeypatch.undo()
    (tmp_path / "config.json").write_text("{}")  # the target directory (make_cfg) gains a file
    with pytest.raises(ValueError, match=r"^prepare: .*the target's files \(target.name_or_path\): \w+ -> \w+"):
        runner.run_stages(make_cfg(tmp_path, "run.stages=[prepare]"), world, calls.fns)
    assert calls == ["prepare"]


ONLINE = ["run.stages=[prepare,capture,train]", "capture.mode=online", "capture.engine=vllm"]
RUNTIME = ["capture.engine_restarts=5", "capture.buffer_batches=8", "capture.tensor_parallel_size=2",
           "capture.engine_timeout_s=60"]


def test_online_runtime_settings_are_not_inputs(tmp_path, calls, world):
    """capture.mode=online: the engine's buffer, restart budget and parallelism do not change the states the trainer
    gets, so raising the restarts of a failing run trains on (run.force=[capture,train] would delete its
    checkpoints); what changes the states still stops the run. The offline store's hash keeps them."""
    runner.run_stages(make_cfg(tmp_path, *ONLINE), world, calls.fns)
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, *ONLINE, *RUNTIME), world, calls.fns)
    assert calls == []
    with pytest.raises(ValueError, match=r"^capture: .*capture.dtype: bf16 -> fp8"):
        runner.run_stages(make_cfg(tmp_path, *ONLINE, "capture.dtype=fp8"), world, calls.fns)
    offline = make_cfg(tmp_path, "capture.engine=vllm")
    assert runner.inputs_hash(offline, stages.STAGES["capture"], {}) != runner.inputs_hash(
        make_cfg(tmp_path, "capture.engine=vllm", "capture.buffer_batches=8"), stages.STAGES["capture"], {})


def _as_an_older_fledge_wrote_it(root, transformers_version, drop_keys=()):
    """Rewrite the run's manifests as an older Fledge would have: other library versions, no record of the
    config keys ``drop_keys`` (which it did not read), each hash over those inputs, chained down the stages."""
    hashes = {}
    for stage in ("prepare", "capture", "train", "export", "eval"):
        path = root / stage / "manifest.json"
        m = json.loads(path.read_text())
        m["inputs"]["versions"]["transformers"] = transformers_version
        for key in drop_keys:
            *parents, last = key.split(".")
            node = m["inputs"]["config"]
            for p in parents:
                node = node.get(p, {})
            node.pop(last, None)
        m["inputs"]["upstream"] = {k: hashes[k] for k in m["inputs"]["upstream"]}
        m["inputs_hash"] = hashes[stage] = runner.digest(m["inputs"])
        path.write_text(json.dumps(m))


def test_a_run_of_an_older_fledge_trains_on_after_an_upgrade(tmp_path, calls, world):
    """After an upgrade (other library versions, keys the older Fledge did not record, at their defaults) the
    run's outputs are kept: nothing is refused, and no force that deletes checkpoints is suggested. A change
    the user made still stops the run as before."""
    five = "run.stages=[prepare,capture,train,export,eval]"
    runner.run_stages(make_cfg(tmp_path, five), world, calls.fns)
    _as_an_older_fledge_wrote_it(tmp_path / "tiny", "4.0.0", drop_keys=["drafter.position_decay"])
    calls.clear()
    got = runner.run_stages(make_cfg(tmp_path, five), world, calls.fns)
    assert calls == ["export", "eval"]  # rebuilt in minutes; prepare, capture and train kept
    assert [got[s]["action"] for s in ("prepare", "capture", "train")] == ["skip"] * 3
    calls.clear()
    runner.run_stages(make_cfg(tmp_path, five), world, calls.fns)
    assert calls == []  # the manifests now record this version: nothing more to say
    _as_an_older_fledge_wrote_it(tmp_path / "tiny", "4.0.0", drop_keys=["drafter.position_decay"])
    with pytest.raises(ValueError, match=r"^train: .*drafter.position_decay: \(absent\) -> 3.0"):
        runner.run_stages(make_cfg(tmp_path, five, "drafter.position_decay=3.0"), world, calls.fns)
    with pytest.raises(ValueError, match=r"^train: .*train.optim.lr: 0.001 -> 0.5"):
        runner.run_stages(make_cfg(tmp_path, five, "train.optim.lr=0.5"), world, calls.fns)
    assert calls == []
