"""Array-job capture through the stage runner: two slice tasks running at the same time in one run
directory (slice 0 on 2 torchrun ranks, slice 1 in this process), then the merge, read back through
FeatureStore sample for sample against a plain capture of the same prepared data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.capture import H, L, N, V, prepare_runs
from tests.helpers.paths import REPO
from tests.helpers.suites import FULL_ONLY

pytestmark = pytest.mark.distributed
TARGET = ["recipe=tiny", "target.dtype=float32", f"target.num_hidden_layers={L}", f"target.hidden_size={H}",
          f"target.vocab_size={V}", "drafter.draft_vocab_size=64", "drafter.aux_layer_ids=[2,3,4]",
          "capture.shard_size_mb=0.02", "capture.batch_tokens=256"]


def _overrides(root: Path, run: str, *extra: str) -> list[str]:
    return [*TARGET, f"run.name={run}", f"run.output_root={root}", f"target.name_or_path={root / 'target'}", *extra]


def _cfg(root: Path, run: str, *extra: str):
    from fledge.conf import compose

    return compose(_overrides(root, run, *extra))


def _run_here(root: Path, run: str, *extra: str) -> dict:
    from fledge.distributed import World
    from fledge.pipeline.runner import run_stages
    from fledge.pipeline.stages import PIPELINE

    return run_stages(_cfg(root, run, *extra), World(0, 1, 0, torch.device("cpu")), PIPELINE)


def _manifest(root: Path, run: str) -> dict:
    return json.loads((root / run / "capture" / "manifest.json").read_text())


@FULL_ONLY  # CI twin: the broken-slice test below runs both slices and their merge
def test_slices_then_merge_equal_a_plain_capture(tmp_path):
    from fledge.data.features.reader import FeatureLoader, FeatureStore

    prepare_runs(tmp_path)  # prepared runs "a" and "b" with the same data
    _run_here(tmp_path, "a", "run.stages=[capture]")  # the plain reference

    task = ["run.stages=[capture]", "capture.num_slices=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1")
    slice0 = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train/main.py",
         *_overrides(tmp_path, "b", *task, "capture.slice_index=0")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _run_here(tmp_path, "b", *task, "capture.slice_index=1")  # while slice 0 runs in the same stage dir
        out, _ = slice0.communicate(timeout=300)
    finally:
        slice0.kill()
    assert slice0.returncode == 0, out[-4000:]
    m = _manifest(tmp_path, "b")
    assert m["complete"] is False and m["partial"] is True
    assert sorted(p.name for p in (tmp_path / "b" / "capture" / "slices").iterdir()) == [
        "slice00000.json", "slice00001.json"]
    assert not (tmp_path / "b" / "capture" / "train" / "store.json").exists()

    # A later run with the slice count and no slice index merges; train would follow in the same run.
    (tmp_path / "b" / "capture" / "slices" / "slice00001.json").rename(tmp_path / "slice1.json")
    with pytest.raises(ValueError, match=r"slices 1 have not finished.*sbatch --array=1 "):
        _run_here(tmp_path, "b", *task)
    (tmp_path / "slice1.json").rename(tmp_path / "b" / "capture" / "slices" / "slice00001.json")
    merged_manifest = _run_here(tmp_path, "b", *task)["capture"]
    assert merged_manifest["complete"] and _manifest(tmp_path, "b")["complete"]
    assert merged_manifest["inputs_hash"] == _manifest(tmp_path, "a")["inputs_hash"]

    for split in ("train", "eval"):
        plain = FeatureStore(tmp_path / "a" / "capture" / split)
        merged = FeatureStore(tmp_path / "b" / "capture" / split)
        assert merged.manifest["indexes"] == ["slice00000/rank00000", "slice00000/rank00001", "slice00001/rank00000"]
        assert merged.sample_ids == plain.sample_ids == list(range(len(plain))) and merged.lengths == plain.lengths
        for i in range(len(plain)):
            a, b = plain[i], merged[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            # other forward batches than the plain capture: fp32 noise below bf16 rounding
            torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"], rtol=8e-3, atol=1e-4)
            torch.testing.assert_close(a["target_hidden"], b["target_hidden"], rtol=8e-3, atol=1e-4)
            assert torch.equal(a["target_argmax"], b["target_argmax"]), (split, i)
    assert len(FeatureStore(tmp_path / "b" / "capture" / "train")) == N
    plans = [FeatureLoader(tmp_path / r / "capture" / "train", 0, 2, 128, 2, seed=1).global_plan(0) for r in "ab"]
    assert plans[0] == plans[1]  # the training batch plan does not depend on how the store was written


def test_a_broken_slice_is_one_line_whose_advice_merges(tmp_path):
    """A slice whose rank indexes do not hold its samples exactly once (here: a shard listed twice) fails
    the merge with one line naming that slice and how to redo it (run.force=[capture] is refused with
    slices); following it, the merge completes."""
    import shutil

    prepare_runs(tmp_path)
    task = ["run.stages=[capture]", "capture.num_slices=2"]
    for i in (0, 1):
        _run_here(tmp_path, "b", *task, f"capture.slice_index={i}")
    index = tmp_path / "b" / "capture" / "train" / "slice00001" / "rank00000" / "index.json"
    broken = json.loads(index.read_text())
    broken["shards"].append(broken["shards"][0])
    index.write_text(json.dumps(broken))

    env = {k: v for k, v in os.environ.items() if k not in ("FLEDGE_DEBUG", "HYDRA_FULL_ERROR")}
    res = subprocess.run([sys.executable, "-m", "fledge", "run", *_overrides(tmp_path, "b", *task)], cwd=REPO,
                         env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-4000:]
    assert len([ln for ln in res.stderr.splitlines() if ln.startswith("fledge: ")]) == 1, res.stderr
    slice1 = tmp_path / "b" / "capture" / "train" / "slice00001"
    for needle in ("slices 1 ", "duplicate", f"delete {slice1}", "sbatch --array=1 ", "capture.slice_index=1"):
        assert needle in res.stderr, (needle, res.stderr)
    assert "run.force=[capture]" not in res.stderr

    shutil.rmtree(slice1)  # the advice: delete the slice's rank directories, rerun it, merge
    _run_here(tmp_path, "b", *task, "capture.slice_index=1")
    assert _run_here(tmp_path, "b", *task)["capture"]["complete"]
    from fledge.data.features.reader import FeatureStore

    assert FeatureStore(tmp_path / "b" / "capture" / "train").sample_ids == list(range(N))

    # A merged store's corrupt shard: the reader's advice names that slice and the stage's manifest, as the
    # trainer opens the store (data/capture/sources.py); run.force is refused here too.
    from fledge.run_layout import RunLayout

    shard = slice1 / "rank00000" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    run = RunLayout(tmp_path / "b")
    store = FeatureStore(run.capture.store("train"), stage_manifest=run.manifest("capture"))
    with pytest.raises(ValueError, match="sha256") as err:
        [store[i] for i in range(len(store))]
    advice = str(err.value)
    assert f"delete {slice1} and {tmp_path / 'b' / 'capture' / 'manifest.json'}" in advice, advice
    assert "capture.slice_index=1" in advice and "run.force" not in advice
    shutil.rmtree(slice1)
    (tmp_path / "b" / "capture" / "manifest.json").unlink()
    _run_here(tmp_path, "b", *task, "capture.slice_index=1")
    assert _run_here(tmp_path, "b", *task)["capture"]["complete"]
    store = FeatureStore(tmp_path / "b" / "capture" / "train")
    assert len([store[i] for i in range(len(store))]) == N
