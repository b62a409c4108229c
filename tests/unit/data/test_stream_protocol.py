"""The online stream's protocol (data/capture/stream.py) with a stand-in engine (tests/helpers/fake_capture_engine.py:
the real driver's run_job over a fake vllm.LLM), in seconds: one engine shared by two ranks hands each the very
batches, in order, that an engine of its own would; a shared engine killed mid-run restarts at the leader's
step start and no batch is lost or consumed twice; a driver started through a launcher stops when its rank's
heartbeat goes stale; the held-out set's engine takes the training engine's place on its GPU; SIGTERM ends a wait
for a batch at once and starts no engine. tests/engine/test_vllm_capture.py runs the same paths with real vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fledge.data.capture.engine import DRIVER
from fledge.data.capture.stream import EngineFeatureSource, StreamInterrupted, StreamSpec
from tests.helpers.models import random_llama

FAKE = Path(__file__).resolve().parents[2] / "helpers" / "fake_capture_engine.py"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset

    root = tmp_path_factory.mktemp("stream")
    random_llama(seed=0).save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in torch.randint(5, 20, (24,), generator=g)]
    Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}).save_to_disk(root / "data")
    python = root / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    python.chmod(0o755)
    return root, python


def _sources(root: Path, python: Path, run: str, k: int, launcher=(), grad_accum: int = 2, timeout_s: float = 60,
             restarts: int = 1, name: str = "train", displaces: list | None = None, **engine):
    spec = dict(**engine, python=python, target=str(root / "target"), revision=None, trust_remote_code=False,
                dtype=torch.float32, feature_dtype=torch.float32, aux_layer_ids=[2, 3, 4], num_layers=6,
                rms_norm_eps=1e-6, aux_dtype="bf16", env={}, timeout_s=timeout_s, buffer_batches=2, restarts=restarts,
                device=torch.device("cpu"), launcher=tuple(launcher), ranks_per_engine=k, grad_accum=grad_accum)
    return [EngineFeatureSource(root / "data", StreamSpec(workdir=root / run / f"rank{r:05d}", **spec), r, 2, 32, 1, 0,
                                name=name, displaces=displaces[r] if displaces else None) for r in range(2)]


def test_the_engine_runs_on_the_tensor_and_expert_parallel_settings(setup, monkeypatch):
    """capture.tensor_parallel_size / capture.expert_parallel reach the streaming engine's request (the env only
    lists its GPUs): a Kimi-class target streamed online needs its TP x EP engine, as offline capture has."""
    import fledge.data.capture.stream as stream

    started = []
    monkeypatch.setattr(stream, "EngineRun", lambda python, req, *a, **kw: started.append(req) or req)
    src = _sources(*setup, "tp_ep", 1, tensor_parallel_size=4, expert_parallel=True)[0]
    src._start([(0, 0, 0)], "train")
    assert (started[0]["tensor_parallel_size"], started[0]["enable_expert_parallel"]) == (4, True)


def _each_rank(srcs, work) -> dict[int, list]:
    """``work(src, out)`` for each rank in its own thread, as two trainer processes would; {rank: out}."""
    out, errors = {s.rank: [] for s in srcs}, []

    def run(src):
        try:
            work(src, out[src.rank])
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in srcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in srcs:
        s.close()
    assert not errors, errors
    return out


def _consume(srcs, kill_after: int | None = None, start: int = 0) -> dict[int, list]:
    """Every rank's training batches from global batch ``start`` on: {rank: [(g, samples)]}; the engine is killed
    after rank 0's kill_after-th."""
    def work(src, out):
        for g in range(start + src.rank, src.end, src.world):
            out.append((g, src._next_from_engine(g)))
            if kill_after is not None and src.rank == 0 and len(out) == kill_after:
                os.killpg(src._run.proc.proc.pid, signal.SIGKILL)  # the engine, and its launcher, die

    return _each_rank(srcs, work)


def _same(a: dict, b: dict) -> None:
    for r in a:
        assert [g for g, _ in a[r]] == [g for g, _ in b[r]] == list(range(r, 2 * len(a[r]), 2))
        for (_, xs), (_, ys) in zip(a[r], b[r]):
            for x, y in zip(xs, ys):
                assert x.keys() == y.keys() and all(torch.equal(x[key], y[key]) for key in x)


@pytest.fixture(scope="module")
def own(setup):
    root, python = setup
    return _consume(_sources(root, python, "own", 1))


def test_an_engine_shared_by_two_ranks_hands_each_the_batches_of_its_own_engine(setup, own):
    root, python = setup
    srcs = _sources(root, python, "shared", 2)
    shared = _consume(srcs)
    _same(shared, own)
    assert [s.engine_starts for s in srcs] == [1, 0]  # the leader started the one engine
    job = json.loads((root / "shared" / "rank00000" / "train" / "request.json").read_text())["jobs"][0]
    assert job["spool_of"][:4] == [0, 1, 0, 1] and job["keys"][:4] == [0, 1, 2, 3]
    for r in range(2):  # every batch consumed and deleted; the record says what each rank read
        assert not list((root / "shared" / f"rank{r:05d}").rglob("*.safetensors"))
        rec = [json.loads(x)["batch"] for x in (root / "shared" / f"rank{r:05d}" / "train-consumed.jsonl").open()]
        assert rec == [g for g, _ in shared[r]]


def test_a_killed_runs_leftover_batches_do_not_hold_the_new_engines_buffer(setup, own):
    """A resumed run finds the killed run's unconsumed batches (keys above its position) in a member's spool;
    left there they would fill its back-pressure room (buffer_batches=2) and the engine would wait forever."""
    root, python = setup
    spool = root / "leftover" / "rank00001" / "train" / "spool" / "train"
    spool.mkdir(parents=True)
    for key in (13, 15):
        (spool / f"batch-{key:07d}.json").write_text('{"samples": []}')
    _same(_consume(_sources(root, python, "leftover", 2, timeout_s=10)), own)


def test_a_shared_engine_killed_mid_run_restarts_at_the_step_start_and_loses_nothing(setup, own, monkeypatch,
                                                                                      caplog):
    root, python = setup
    monkeypatch.setenv("FAKE_ENGINE_DELAY_S", "0.05")  # so the member is still waiting when the engine dies
    srcs = _sources(root, python, "killed", 2, launcher=["timeout", "300"])
    _same(_consume(srcs, kill_after=3), own)
    assert srcs[0].engine_starts == 2
    # the dead engine's log is kept (the restarted engine's used to overwrite it), and the restart line names it
    kept = (root / "killed" / "rank00000" / "train" / "engine.1.log").resolve()
    assert kept.is_file() and (kept.parent / "engine.log").is_file()
    assert [r for r in caplog.records if "the engine died" in r.getMessage() and str(kept) in r.getMessage()]
    restarted = json.loads((root / "killed" / "rank00000" / "train" / "request.json").read_text())
    assert restarted["jobs"][0]["keys"][0] == 4  # the leader's 4th batch (g=6) is in the step that began at g=4
    assert restarted["owner"]["heartbeat"].endswith("owner.alive")


def test_a_relative_run_directory_streams_where_the_trainer_reads(setup, own, monkeypatch):
    """run.output_root=outputs (the default) makes every path relative to the trainer's directory, but the engine's
    driver runs in a work directory of its own: a spool, target or engine python handed over as a relative path
    resolves there, the batches land where no trainer reads, and the trainer waits for the whole timeout."""
    import shutil

    root, python = setup
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy(python, root / "bin" / "python")
    monkeypatch.chdir(root)
    srcs = _sources(Path("."), Path("bin/python"), "relative", 2, timeout_s=20, restarts=0)
    _same(_consume(srcs), own)


def test_an_engine_writing_where_the_trainer_cannot_see_fails_in_one_line_at_once(setup, monkeypatch):
    """An engine whose buffer fills where this rank does not read (here a spool handed over as a relative path,
    which the driver resolves in its own directory; on a cluster, a file system its node does not share) would wait
    for room forever, and the trainer for its batch until capture.engine_timeout_s: the trainer fails within
    seconds instead, naming where the batches went."""
    import os

    import fledge.data.capture.stream as stream

    root, python = setup
    monkeypatch.chdir(root)

    def relative(*args, **kw):
        req = build_request(*args, **kw)
        for job in req["jobs"]:
            job["spools"] = [os.path.relpath(p) for p in job["spools"]]
        return req

    build_request = stream.build_request
    monkeypatch.setattr(stream, "build_request", relative)
    src = _sources(root, python, "unseen", 1, timeout_s=300)[0]
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        src._next_from_engine(0)
    assert time.monotonic() - t0 < 60 and src.engine_starts == 1 and src._run is None
    msg, work = str(e.value), root / "unseen" / "rank00000" / "train"
    assert "\n" not in msg and "does not see" in msg and str(work / "unseen") in msg, msg


def test_a_shared_engine_restarts_at_the_step_start_of_a_run_resumed_off_the_step_size(setup, own, monkeypatch):
    """A run resumed at global batch 2 with steps of 4 (after a change of grad_accum or world size): its steps are
    [2..5], [6..9], ... Killed after the leader's batch 6, the engine must start again at 6 (the member may still
    wait for 7), not at 8, a multiple of the step size, which would leave the member waiting for a batch the
    restarted engine never makes."""
    root, python = setup
    monkeypatch.setenv("FAKE_ENGINE_DELAY_S", "0.05")  # so the member is still waiting when the engine dies
    srcs = _sources(root, python, "offset", 2, timeout_s=10)
    for src in srcs:
        src.seek(2)
    got = _consume(srcs, kill_after=3, start=2)
    for r in got:
        assert [g for g, _ in got[r]] == [g for g, _ in own[r]][1:]
        for (_, xs), (_, ys) in zip(got[r], own[r][1:]):
            assert all(torch.equal(x[key], y[key]) for x, y in zip(xs, ys) for key in x)
    assert srcs[0].engine_starts == 2
    restarted = json.loads((root / "offset" / "rank00000" / "train" / "request.json").read_text())
    assert restarted["jobs"][0]["keys"][0] == 6


def test_eval_through_a_shared_engine_pads_and_keys_each_evaluation_anew(setup):
    root, python = setup
    srcs = _sources(root, python, "eval", 2)

    def work(src, out):
        for _ in range(2):  # two evaluations: the second one's keys are above the first's
            out.append([(b.input_ids.clone(), real) for b, real in src.eval_batches(5)])

    got = _each_rank(srcs, work)
    assert [real for _, real in got[0][0]] == [True, True, True]
    assert [real for _, real in got[1][0]] == [True, True, False]
    for r in range(2):
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got[r][0], got[r][1]))
    assert torch.equal(got[1][0][2][0], got[0][0][0][0])  # the pad re-reads batch 0


def test_the_held_out_engine_takes_the_training_engines_place_and_training_goes_on(setup, own, monkeypatch):
    """On a GPU the training engine and the held-out set's each ask for 0.85 of the device's memory (the stand-in:
    a lock on one file), so an evaluation between training batches can only start its engine once the training
    engine has stopped; the next training batch starts one again where the data stood, nothing lost or repeated."""
    root, python = setup
    monkeypatch.setenv("FAKE_ENGINE_GPU", str(root / "gpu.lock"))
    trains = _sources(root, python, "displaced", 1)
    train, held_out = trains[0], _sources(root, python, "displaced", 1, name="eval", displaces=trains)[0]
    try:
        got = [(0, train._next_from_engine(0))]
        assert [real for _, real in held_out.eval_batches(4)] == [True, True]
        got += [(g, train._next_from_engine(g)) for g in (2, 4)]
    finally:
        train.close()
    _same({0: got}, {0: own[0][:3]})
    assert train.engine_starts == 2 and held_out.engine_starts == 1


def test_sigterm_ends_a_wait_for_a_batch_at_once_and_starts_no_engine(setup, monkeypatch):
    """Slurm's SIGTERM reaches the engines too. A rank waiting for a batch must give the wait up at once (the
    trainer then checkpoints), not start the dead engine again and wait for it to load: here every engine started
    after the first one hung loads forever. The same for the held-out set's engine."""
    root, python = setup
    monkeypatch.setenv("FAKE_ENGINE_HANG_AT", f"1:{root / 'hung'}")  # the engine hangs before its 2nd batch
    trains = _sources(root, python, "interrupted", 1, timeout_s=60, restarts=1)
    train, held_out = trains[0], _sources(root, python, "interrupted", 1, name="eval", displaces=trains)[0]
    stop = threading.Event()
    train.stop_requested = held_out.stop_requested = stop.is_set
    train._next_from_engine(0)

    def sigterm():  # to the trainer (its flag) and to the engine, as slurmstepd signals every process of the job
        stop.set()
        os.killpg(train._run.proc.proc.pid, signal.SIGTERM)

    threading.Timer(1.0, sigterm).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StreamInterrupted, match="global batch 2"):
            train._next_from_engine(2)
        with pytest.raises(StreamInterrupted, match="held-out"):
            next(iter(held_out.eval_batches(2)))
    finally:
        train.close()
    assert time.monotonic() - t0 < 10 and (root / "hung").exists()
    assert train.engine_starts == 1 and held_out.engine_starts == 0


def _driver():
    spec = importlib.util.spec_from_file_location("capture_driver_under_test", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_launched_driver_is_orphaned_when_its_ranks_heartbeat_goes_stale(tmp_path):
    drv = _driver()
    beat = tmp_path / "owner.alive"
    beat.touch()
    drv.OWNER.update(heartbeat=str(beat), stale_s=30)
    assert not drv._orphaned()
    os.utime(beat, (time.time() - 31, time.time() - 31))
    assert drv._orphaned()
    beat.unlink()
    assert drv._orphaned()
