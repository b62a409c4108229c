"""The engine drivers' processes (fledge/engine_process.py), with a stand-in engine: a driver whose children
outlive it (vLLM's EngineCore and GPU workers do) is ended as a whole process group on a timeout, one of
them ignoring SIGTERM; the timeout says what happened. And vLLM data parallelism: a rank with no work left
still starts its engine and takes part until every rank's engine is done (tests/engine/ runs real vLLM)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fledge.data.capture.engine import DRIVER
from tests.helpers.models import random_llama
from tests.helpers.processes import descendants

# A driver that starts a worker ignoring SIGTERM (with a child of its own) and a second child, then waits:
# killing only the driver's pid leaves all three running.
TREE = """#!/bin/sh
sh -c 'trap "" TERM; sleep 600 & sleep 600' &
sleep 600 &
wait
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr("fledge.engine_process.GRACE_S", 1.0)  # the SIGTERM-deaf worker waits this long
    fake = tmp_path / "python"
    fake.write_text(TREE)
    fake.chmod(0o755)
    return fake


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds nothing; whoever adopted it reaps it


def _tree_of_this_test(stand_in: Path, before: set[int], n: int = 3, wait_s: float = 60) -> list[int]:
    """The stand-in's processes below this test process, once all ``n`` sleeps have started: the descendants
    new since ``before`` the driver started that run the stand-in or its sleeps. The session's background
    builds and family runs (tests/conftest.py's _ahead) are descendants of this process too, and live on."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = [p for p in descendants(os.getpid()) if p not in before
                and (b"sleep" in _cmdline(p) or str(stand_in).encode() in _cmdline(p))]
        sleeps = [p for p in pids if b"sleep" in _cmdline(p)]
        if len(sleeps) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError("the stand-in engine did not start its processes")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended while we looked
        return b""


def test_eval_engine_timeout_ends_every_process_the_driver_started(stand_in, tmp_path):
    from fledge.serving.engine import EngineError, run_driver

    caught: list[BaseException] = []

    def serve():
        try:
            run_driver("vllm", stand_in, {"sets": {}}, tmp_path / "engine", timeout_s=3)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            caught.append(e)

    before = set(descendants(os.getpid()))
    t = threading.Thread(target=serve)
    t.start()
    tree = _tree_of_this_test(stand_in, before)
    t.join(60)
    assert not t.is_alive() and caught and isinstance(caught[0], EngineError), caught
    assert not [p for p in tree if _alive(p)], "engine processes outlived the timeout"
    msg = str(caught[0])
    for needle in ("eval.engine=vllm", "eval.engine_timeout_s=3", str(tmp_path / "engine" / "engine.log"),
                   "processes were ended", "raise eval.engine_timeout_s"):
        assert needle in msg, (needle, msg)


def _capture_request(tmp_path: Path) -> tuple[dict, dict]:
    import numpy as np

    from fledge.data.capture.engine import build_request

    np.arange(4, dtype=np.int32).tofile(tmp_path / "t.bin")
    job = {"name": "train", "spool": str(tmp_path / "engine" / "spool" / "train"), "tokens": str(tmp_path / "t.bin"),
           "batches": [[[0, 0, 4]]]}
    req = build_request("t", None, False, "float32", 8, [0, 2, 6], 1, False, 1, {}, tmp_path / "engine", [job])
    return req, job


def test_capture_engine_timeout_ends_every_process_the_driver_started(stand_in, tmp_path):
    from fledge.data.capture.engine import EngineRun

    req, job = _capture_request(tmp_path)
    before = set(descendants(os.getpid()))
    run = EngineRun(stand_in, req, tmp_path / "engine", timeout_s=3)
    tree = _tree_of_this_test(stand_in, before)
    with pytest.raises(ValueError) as err:
        next(run.batches(job))
    assert not [p for p in tree if _alive(p)], "engine processes outlived the timeout"
    msg = str(err.value)
    for needle in ("capture.engine=vllm", "capture.engine_timeout_s=3", "batch 1 of 1 of split 'train'",
                   str(tmp_path / "engine" / "engine.log"), "processes were ended", "raise capture.engine_timeout_s"):
        assert needle in msg, (needle, msg)


def test_capture_engine_that_does_not_exit_is_a_user_error_and_is_ended(stand_in, tmp_path):
    from fledge.data.capture.engine import EngineRun

    req, _ = _capture_request(tmp_path)
    before = set(descendants(os.getpid()))
    run = EngineRun(stand_in, req, tmp_path / "engine", timeout_s=2)
    tree = _tree_of_this_test(stand_in, before)
    with pytest.raises(ValueError,
                       match=r"did not exit after its last batch; no progress for capture.engine_timeout_s=2 s"):
        run.finish()
    assert not [p for p in tree if _alive(p)]


def test_a_data_parallel_rank_with_no_work_left_still_starts_its_engine(tmp_path):
    """On resume a rank may have captured everything; its engine is one rank of the vLLM DP group the
    others' engines wait for, so it starts (with no jobs) instead of being skipped."""
    from fledge.data.capture.engine import capture_with_engine

    model_dir = tmp_path / "target"
    random_llama(seed=3).save_pretrained(model_dir)
    fake = tmp_path / "python"
    # Records its request; writes the result a driver with no work writes.
    fake.write_text('#!/bin/sh\ncp "$3" "$(dirname "$3")/seen.json"\necho \'{"jobs": {}}\' > "$4"\n')
    fake.chmod(0o755)
    done = SimpleNamespace(ds=None, todo=lambda: [], lengths=[5, 3])
    parallel = {"tensor_parallel_size": 1, "expert_parallel": False, "data_parallel_size": 2,
                "data_parallel_rank": 1, "data_parallel_done": str(tmp_path / "engine" / "dp-x")}
    out = capture_with_engine({"train": done}, fake, str(model_dir), None, False, torch.float32, [2, 3, 4], 6, 1e-6,
                              parallel, {}, tmp_path / "engine" / "rank00001", 60, "cpu")
    seen = json.loads((tmp_path / "engine" / "rank00001" / "seen.json").read_text())
    assert seen["data_parallel"] == {"size": 2, "rank": 1, "done_dir": str(tmp_path / "engine" / "dp-x")}
    assert [j["batches"] for j in seen["jobs"]] == [[]] and out == {"jobs": {}}


def _driver():
    spec = importlib.util.spec_from_file_location("engine_capture_driver", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Engine:
    """Stands in for vllm.LLM: answers each request with one token and a connector file, as the driver sees."""

    def __init__(self, connector: Path):
        self.connector, self.calls = connector, 0
        connector.mkdir(parents=True, exist_ok=True)

    def generate(self, prompts, params, use_tqdm=False):
        self.calls += 1
        outs = []
        for i, _ in enumerate(prompts):
            path = self.connector / f"req-{self.calls}-{i}.safetensors"
            path.write_bytes(b"x")
            outs.append(SimpleNamespace(kv_transfer_params={"hidden_states_path": str(path)},
                                        outputs=[SimpleNamespace(token_ids=[7])]))
        return outs


def test_dp_driver_takes_part_until_every_rank_is_done(tmp_path, monkeypatch):
    """A DP rank whose jobs are done keeps its engine in the group's steps (placeholder requests) until the
    other ranks' engines are done too, and leaves none of those requests' files behind."""
    drv = _driver()
    monkeypatch.setattr(drv, "_sampling", lambda: None)
    engine = _Engine(tmp_path / "connector")
    req = {"data_parallel": {"size": 2, "rank": 0, "done_dir": str(tmp_path / "dp")}}
    peer = tmp_path / "dp" / "rank00001.done"

    def peer_finishes():
        while engine.calls < 5:
            time.sleep(0.01)
        peer.write_text("done\n")

    t = threading.Thread(target=peer_finishes)
    t.start()
    drv.take_part_until_all_done(engine, req)
    t.join()
    assert (tmp_path / "dp" / "rank00000.done").exists()
    assert engine.calls >= 5 and not list((tmp_path / "connector").iterdir())
    calls = engine.calls
    drv.take_part_until_all_done(engine, {"data_parallel": None})  # no DP group: nothing to wait for
    drv.take_part_until_all_done(engine, req)  # every rank done: returns at once
    assert engine.calls == calls


def test_an_engine_started_again_keeps_the_earlier_engines_log(tmp_path, monkeypatch):
    """Each engine's log was opened with "w" in the same work directory, so a restarted engine (capture's
    capture.engine_restarts, a resumed run) overwrote the dead one's: the only file that said why it died. The
    earlier logs are kept as engine.1.log, engine.2.log, ..."""
    from fledge.engine_process import DriverProcess

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "engine $STAND_IN_NO"\n')
    fake.chmod(0o755)
    drivers = []
    for n in (1, 2, 3):
        monkeypatch.setenv("STAND_IN_NO", str(n))
        drivers.append(DriverProcess(fake, tmp_path / "driver.py", tmp_path / "engine", {}))
        assert drivers[-1].wait(60) == 0
        drivers[-1].stop()
    logs = {p.name: p.read_text() for p in (tmp_path / "engine").glob("engine*.log")}
    assert logs == {"engine.1.log": "engine 1\n", "engine.2.log": "engine 2\n", "engine.log": "engine 3\n"}
    work = (tmp_path / "engine").resolve()
    assert [d.kept_log for d in drivers] == [None, work / "engine.1.log", work / "engine.2.log"]
