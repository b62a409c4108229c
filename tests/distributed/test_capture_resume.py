"""Offline capture on 2 ranks (torchrun, gloo): kill -9 in the middle, re-run, and the store is
byte-identical to an uninterrupted run's (no sample lost or duplicated, temporaries cleaned up)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.capture import H, L, N, V, prepare_runs
from tests.helpers.paths import REPO
from tests.helpers.processes import descendants
from tests.helpers.suites import FULL_ONLY


def _cmd(root: Path, run: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "tests.helpers.capture_entry",
            "recipe=tiny", f"run.name={run}", f"run.output_root={root}", "run.stages=[capture]",
            f"target.name_or_path={root / 'target'}", "target.dtype=float32", f"target.num_hidden_layers={L}",
            f"target.hidden_size={H}", f"target.vocab_size={V}", "drafter.draft_vocab_size=64",
            "drafter.aux_layer_ids=[2,3,4]",
            "capture.shard_size_mb=0.02", "capture.batch_tokens=256"]


def _env(slow: float = 0.0) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", FLEDGE_TEST_SLOW=str(slow))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _shards(d: Path, rank: int) -> int:
    try:
        return len(json.loads((d / f"rank{rank:05d}" / "index.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@FULL_ONLY  # CI twin: tests/unit/data/test_features.py test_resume_after_lost_shards_is_identical
def test_kill9_then_resume_is_byte_identical(tmp_path):
    prepare_runs(tmp_path)
    subprocess.run(_cmd(tmp_path, "a"), cwd=REPO, env=_env(), check=True, timeout=240, capture_output=True)

    proc = subprocess.Popen(_cmd(tmp_path, "b"), cwd=REPO, env=_env(slow=0.15),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    train = tmp_path / "b" / "capture" / "train"
    deadline = time.time() + 180
    try:
        while not (_shards(train, 0) >= 2 and _shards(train, 1) >= 2):
            assert proc.poll() is None, "the slowed run ended before it could be killed"
            assert time.time() < deadline, "no shards appeared"
            time.sleep(0.05)
    finally:
        for pid in [proc.pid] + descendants(proc.pid):  # kill -9 the launcher and both ranks
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    time.sleep(0.5)
    assert not (tmp_path / "b" / "capture" / "manifest.json").read_text().count('"complete": true')
    assert not (train / "store.json").exists()
    partial = _shards(train, 0) + _shards(train, 1)

    out = subprocess.run(_cmd(tmp_path, "b"), cwd=REPO, env=_env(), timeout=240, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming after" in out.stderr  # rank 0 kept its finished shards

    a, b = tmp_path / "a" / "capture", tmp_path / "b" / "capture"
    for split in ("train", "eval"):
        fa, fb = _files(a / split), _files(b / split)
        assert fa.keys() == fb.keys()
        assert [k for k in fa if fa[k] != fb[k]] == []
    m = json.loads((a / "train" / "store.json").read_text())
    assert m["num_samples"] == N and m["world_size"] == 2 and len(m["shards"]) > partial
    assert json.loads((b / "manifest.json").read_text())["complete"]
