"""`fledge run` stopped by SIGTERM (Slurm, `kill`), SIGINT (Ctrl-C) or SIGHUP (a closed terminal), in one process and
on 2 ranks under its own torchrun agent (pipeline/torchrun.py): no process of it survives, the engine's included (a
stand-in whose processes wait forever: fledge/engine_process.py must end its group), and it exits with one line and
no traceback. One process is stopped in the capture stage (fledge/signals.py: every `finally` runs, exit 128 +
the signal); two ranks in training, where the trainer checkpoints at the step boundary and exits 75, which the
agent passes on (it was torch's SignalException traceback and exit code 1). While they wait, the stores listen on
127.0.0.1 only (fledge/distributed.py loopback_store: torch's listen on every interface, unauthenticated)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import ENV
from tests.helpers.processes import alive, descendants, listening
from tests.helpers.suites import FULL_ONLY

pytestmark = pytest.mark.distributed
# The engine's python: a driver that starts two processes and waits for them, forever (a vLLM that loads).
STAND_IN = "#!/bin/sh\nsleep 600 &\nsleep 600 &\nwait\n"
SMALL = ["drafter.ttt_steps=2", "drafter.draft_vocab_size=1024", "data.perturb.fraction=0", "capture.engine=vllm",
         "capture.engine_timeout_s=300", "target.dtype=float32", "train.max_steps=4", "run.output_root=out"]


@pytest.fixture(scope="module")
def work(tmp_path_factory, random_tiny_target, tiny_data) -> tuple[Path, list[str]]:
    """(work dir, the overrides every run shares), with the prepare stage done once in ``out/base``."""
    work = tmp_path_factory.mktemp("stop_signals")
    engine = work / "engine-python"
    engine.write_text(STAND_IN)
    engine.chmod(0o755)
    ov = ["recipe=tiny", f"target.name_or_path={random_tiny_target}", f"capture.engine_python={engine}",
          f"data.sources.0.path={tiny_data}/train.jsonl", "data.sources.0.max_samples=24",
          f"data.eval_sources.0.path={tiny_data}/eval.jsonl", "data.eval_sources.0.max_samples=4", *SMALL]
    res = subprocess.run([sys.executable, "-m", "fledge", "run", *ov, "run.name=base", "run.stages=[prepare]"],
                         cwd=work, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return work, ov


def _engine_started(pid: int, wait_s: float = 240) -> list[int]:
    """The command's process tree once the stand-in engine's two processes run."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        tree = descendants(pid)
        if sum(b"sleep\x00600" in _cmdline(p) for p in tree) >= 2:
            return tree
        if not alive(pid):
            break
        time.sleep(0.2)
    raise AssertionError("the run did not start its engine")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stopped(work, name: str, args: list[str], sig: signal.Signals) -> tuple[int, str, list[int]]:
    """Run ``fledge run ARGS`` as run ``name`` (prepared), send ``sig`` once its engine runs; (exit code, stderr,
    the processes it had then that still run)."""
    root, ov = work
    shutil.copytree(root / "out" / "base" / "prepare", root / "out" / name / "prepare")
    err = root / f"{name}.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "fledge", "run", *args, *ov, f"run.name={name}"], cwd=root,
                                env=ENV, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    tree = []
    try:
        tree = _engine_started(proc.pid)
        stores = [addr for addr, _ in listening(proc.pid)]  # one process: its store and gloo; 2 ranks: the agent's
        assert stores and all(a.is_loopback for a in stores), stores
        os.kill(proc.pid, sig)  # as `kill`, Slurm or a terminal sends it: to the command's process
        code = proc.wait(timeout=180)
        time.sleep(0.5)  # an orphan that was about to go
        return code, err.read_text(), [p for p in tree if alive(p)]
    finally:
        for p in [proc.pid, *tree]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def _one_line(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-6000:]
    return [line for line in stderr.splitlines() if line.startswith("fledge: ")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_one_process_stopped_in_capture_ends_its_engine(work, sig):
    code, stderr, left = _stopped(work, f"one_{sig.name}", ["run.stages=[capture]", "capture.mode=offline"], sig)
    assert not left, f"processes of the run outlived it: {left}"
    assert code == 128 + sig, stderr[-6000:]
    assert _one_line(stderr) == [f"fledge: stopped by {sig.name}; the stages done are kept: re-run the same "
                                 "command to go on"], stderr[-6000:]


# SIGINT and SIGHUP in the full suite (CI's 30 minutes): the agent forwards every signal by one handler, and the
# one-process cases of each signal above are their CI twins.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=FULL_ONLY),
                                 pytest.param(signal.SIGHUP, marks=FULL_ONLY)], ids=lambda s: s.name)
def test_two_ranks_stopped_in_training_checkpoint_and_exit_75(work, sig):
    name = f"two_{sig.name}"
    code, stderr, left = _stopped(work, name, ["--nproc-per-node", "2", "run.stages=[train]", "capture.mode=online"],
                                  sig)
    assert not left, f"processes of the run outlived it: {left}"
    assert code == 75, stderr[-6000:]
    assert _one_line(stderr) == ["fledge: preempted: checkpoint written at step 0; re-run the same command to "
                                 "resume"], stderr[-6000:]
    assert (work[0] / "out" / name / "train" / "checkpoints" / "latest").read_text() == "step_00000000"
