"""What a config change does to a finished run, through the real entry point (one process, an untrained tiny
target): a longer run trains on from its last checkpoint, then export and eval are made again; a shorter
one, or a changed input of train, stops with one line and deletes nothing; export.push_to_hub turned on
publishes, after eval, with that eval's figures (to a local stand-in for the Hub).

The tests share one run directory and run in file order, each starting from the state the previous one left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fledge.models.drafter_checkpoint import DrafterCheckpoint
from tests.helpers.hub_stub import Stub, commit_files, serve
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.distributed
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
SMALL = ["drafter.ttt_steps=2", "drafter.draft_vocab_size=1024", "train.micro_batch_tokens=256",
         "train.log_every=1", "train.eval_every=2", "train.eval_batches=2", "train.save_every=2", "train.keep_last=2",
         "train.optim.warmup_steps=2", "train.optim.lr=3e-3", "export.checkpoint=last", "eval.sets=[default]",
         "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.drift_depth=2", "eval.heldout_steps=2",
         "data.perturb.fraction=0"]


def fledge(run, *overrides: str, env: dict | None = None, nproc: int = 1, timeout: int = 600
           ) -> subprocess.CompletedProcess:
    out, target, data = run
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launch, "train/main.py", "recipe=tiny", f"target.name_or_path={target}",
           f"run.output_root={out}",
           "run.name=changes", f"data.sources.0.path={data}/train.jsonl", "data.sources.0.max_samples=60",
           f"data.eval_sources.0.path={data}/eval.jsonl", "data.eval_sources.0.max_samples=8", *SMALL, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout + res.stderr


def manifest(run, stage: str) -> dict:
    return json.loads((run[0] / "changes" / stage / "manifest.json").read_text())


def user_error(res: subprocess.CompletedProcess, rc: int = 2) -> str:
    """The one line a user error prints (exit code 2, no traceback from Fledge's code; torchrun exits 1 for its
    ranks' 2 and prints its own ChildFailedError traceback)."""
    assert res.returncode == rc, res.stdout[-3000:] + res.stderr[-5000:]
    assert not re.search(r'File "[^"]*/(train|data|models|conf|fledge)/', res.stderr), res.stderr[-5000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("fledge: ")]
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def checkpoints(run) -> dict[str, float]:
    ckpt = run[0] / "changes" / "train" / "checkpoints"
    return {str(p.relative_to(ckpt)): p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory, random_tiny_target, tiny_data):
    """Every stage once, 4 steps."""
    run = (tmp_path_factory.mktemp("run_changes"), random_tiny_target, tiny_data)
    ok(fledge(run, "train.max_steps=4"))
    assert manifest(run, "train")["outputs"]["steps"] == 4 and manifest(run, "eval")["complete"]
    return run


def test_raising_max_steps_trains_on_then_exports_and_evaluates_again(run):
    before = {s: manifest(run, s).get("output_id") for s in ("prepare", "capture", "export", "eval")}
    log = ok(fledge(run, "train.max_steps=6"))
    assert "resumed from step_00000004 at step 4" in log  # from its last checkpoint, not from scratch
    train, export, evals = (manifest(run, s) for s in ("train", "export", "eval"))
    assert train["outputs"]["steps"] == 6
    assert export["outputs"]["checkpoint"].endswith("step_00000006/drafter")
    drafter = Path(export["outputs"]["drafter"])
    assert DrafterCheckpoint.read_record(drafter)["step"] == 6
    assert export["output_id"] != before["export"] and evals["output_id"] != before["eval"]
    assert evals["read"]["export"] == export["output_id"]  # eval measured the new export
    assert {s: manifest(run, s).get("output_id") for s in ("prepare", "capture")} == \
        {s: before[s] for s in ("prepare", "capture")}
    assert "train    [ran on from its own output] steps=6" in log  # the closing summary says what it did


def test_lowering_max_steps_stops_with_one_line(run):
    before = checkpoints(run)
    line = user_error(fledge(run, "train.max_steps=3"))
    assert "train: this run has trained 6 steps and train.max_steps=3 asks for 3" in line, line
    assert "run.force=[train]" in line and "new run.name" in line, line
    assert checkpoints(run) == before


def test_a_changed_input_of_train_stops_and_deletes_nothing(run):
    before = checkpoints(run)
    line = user_error(fledge(run, "train.max_steps=6", "train.optim.lr=1e-3"))
    assert "train: its inputs changed since it ran (train.optim.lr: 0.003 -> 0.001)" in line, line
    assert "run.force=[train]" in line and "new run.name" in line, line
    assert checkpoints(run) == before and manifest(run, "train")["complete"]


@pytest.mark.parametrize("overrides,said", [
    (["capture.dtype=fp8"], "capture: its inputs changed since it ran (capture.dtype: bf16 -> fp8); its output is "
                            "kept: run.force=[capture] starts capture over"),
    (["run.force=[capture]"], "train: its inputs changed since it ran (capture's output: starts over in this "
                              "command); its output is kept: run.force=[capture,train] starts train over"),
])
def test_other_changes_stop_before_anything_runs(run, overrides, said):
    before = checkpoints(run)
    store = sorted(p.name for p in (run[0] / "changes" / "capture").rglob("*"))
    line = user_error(fledge(run, "train.max_steps=6", *overrides))
    assert said in line, line
    assert checkpoints(run) == before and sorted(p.name for p in (run[0] / "changes" / "capture").rglob("*")) == store


def test_cadence_keys_continue(run):
    log = ok(fledge(run, "train.max_steps=6", "train.save_every=3", "train.keep_last=5", "train.eval_batches=1"))
    for stage in ("train", "export", "eval"):
        assert f"{stage:<8} [up to date]" in log, log[-3000:]


def test_turning_push_to_hub_on_publishes_this_runs_eval(run):
    """Nothing else runs again; the card carries the AL this run's eval measured on this export."""
    al = manifest(run, "eval")["outputs"]["al_default"]
    with serve() as hub:
        env = {**ENV, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub, "HF_TOKEN": "hf_stub_token"}
        log = ok(fledge(run, "train.max_steps=6", "export.push_to_hub=true", "export.repo_id=org/drafter", env=env))
        files = commit_files(Stub.calls)
    assert "hf_stub_token" not in log
    assert manifest(run, "publish")["outputs"]["pushed"] is True
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert f"{al:.3f}" in files["README.md"].decode()
    for stage in ("train", "export", "eval"):
        assert f"{stage:<8} [up to date]" in log, log[-3000:]


def test_an_eval_key_makes_eval_and_publish_again(run):
    with serve() as hub:
        env = {**ENV, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub, "HF_TOKEN": "hf_stub_token"}
        log = ok(fledge(run, "train.max_steps=6", "export.push_to_hub=true", "export.repo_id=org/drafter",
                        "eval.max_new_tokens=6", env=env))
        assert any("/commit/" in p for p, _, _ in Stub.calls)
    for stage, said in (("train", "up to date"), ("export", "up to date"), ("eval", "started over"),
                        ("publish", "started over")):
        assert f"{stage:<8} [{said}]" in log, log[-3000:]
    assert "eval.max_new_tokens: 8 -> 6" in log


def test_another_world_size_and_grad_accum_go_on_at_the_global_batch_consumed(run):
    """Last, since it trains on: 2 ranks resume the 1-rank run at the global batch its 6 steps consumed,
    with a warning that the step's size changed; then 1 rank x grad_accum 2 keeps that size, silently."""
    log = ok(fledge(run, "train.max_steps=8", nproc=2))
    assert "resumed from step_00000006_universal at step 6, global batch 6" in log, log[-3000:]
    assert "the optimizer step now takes 2 global batches (train.grad_accum=1 x 2 data-parallel ranks) where the " \
           "checkpoint's took 1" in log
    train = manifest(run, "train")["outputs"]
    assert train["steps"] == 8 and train["global_batches"] == 10  # 6 x 1 + 2 x 2
    log = ok(fledge(run, "train.max_steps=9", "train.grad_accum=2"))
    assert "at step 8, global batch 10" in log and "the optimizer step now takes" not in log, log[-3000:]
    assert manifest(run, "train")["outputs"]["global_batches"] == 12
