"""The suite's fixtures (shared code lives in tests/helpers/): offline, deterministic, CPU; the order the
tests run in, so the slow inputs built in the background are ready when needed."""

import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import fledge.testbed.targets as tiny_targets  # noqa: E402
import fledge.testbed.tiny_writer as tiny_writer  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402
from tests.helpers.processes import descendants  # noqa: E402
from tests.helpers.recipe_runs import run_family, run_recipe  # noqa: E402
from tests.helpers.slurm_cluster import LocalSlurm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip_gpu)
    # The trained tiny targets and the family recipe runs start in the background with the session (_ahead):
    # modules that need none of them run first, then those that need the tiny Llama, then the family runs'.
    group: dict[str, int] = {}
    for item in items:
        group[item.nodeid.split("::")[0]] = max(group.get(item.nodeid.split("::")[0], 0), _needs(item))
    items.sort(key=lambda item: group[item.nodeid.split("::")[0]])


def _needs(item) -> int:
    """0: no trained tiny target (or the test is skipped); 1: the tiny Llama (``tiny_target``, directly or through
    a fixture); 2: a tiny family run (``tiny_family_run``)."""
    skipped = any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
                  for m in item.iter_markers())
    names = set() if skipped else set(getattr(item, "fixturenames", ()))
    return 2 if "tiny_family_run" in names else 1 if "tiny_target" in names else 0


@pytest.fixture(scope="session")
def tiny_target():
    """Path of the tiny recipe's target (a trained Llama + chat tokenizer), built once into .cache (~4 min on 2
    cores; a session that needs it starts the build in the background as it begins: _ahead)."""
    return tiny_targets.build("llama")


@pytest.fixture(scope="session")
def tiny_data():
    """Path of the tiny recipe's data dir (train.jsonl, eval.jsonl, ...), built once into .cache (seconds)."""
    return tiny_writer.build_data()


@pytest.fixture(scope="session")
def tiny_recipe_run(tmp_path_factory, tiny_target):
    """(run dir, log) of the README's main command, `recipe=tiny`, run once per session and shared by
    tests/integration (the golden figures) and tests/engine (vLLM serves its export; tests/helpers/recipe_runs.py)."""
    return run_recipe("tiny", tiny_target, tmp_path_factory.mktemp("tiny_recipe"))


FAMILIES = ("moe", "mla")


@pytest.fixture(scope="session", autouse=True)
def _ahead(request, tmp_path_factory):
    """Start what the session's tests will wait for, in the background, as the session starts: the tiny
    Llama's build (`fledge tiny-target`, ~4 min on 2 cores in CI) while the modules that need no trained target
    run (pytest_collection_modifyitems orders them first; the ``tiny_target`` fixture then waits on the build's
    lock), and both tiny family runs (tests/helpers/recipe_runs.py) at the lowest CPU priority, on the cores the rest
    of the suite leaves idle. FLEDGE_AHEAD=0 builds and runs each in the foreground when first needed.
    Yields None or (family process, its output dir)."""
    import signal
    import subprocess
    import sys

    needs = {_needs(item) for item in request.session.items}
    if os.environ.get("FLEDGE_AHEAD") == "0" or not needs - {0}:
        yield None
        return
    out = tmp_path_factory.mktemp("ahead")
    root, procs = REPO, []
    if needs & {1}:
        with open(out / "tiny_target.log", "w") as log:
            # one thread, as scripts/test.sh builds it and recipes/tiny/golden.json was measured
            procs.append(subprocess.Popen([sys.executable, "-m", "fledge", "tiny-target"], cwd=root, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
    family = None
    if needs & {2}:
        with open(out / "family_runs.log", "w") as log:
            family = subprocess.Popen([sys.executable, "-m", "tests.helpers.recipe_runs", str(out), *FAMILIES],
                                      cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(family)
    yield (family, out) if family else None
    for proc in procs:  # the session ended early (-x, a subset): stop what is left, ranks and engines included
        if proc.poll() is None:
            for pid in descendants(proc.pid) + [proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="session")
def tiny_family_run(tmp_path_factory, _ahead):
    """``run(family)`` -> (run dir, log) of `recipe=tiny_<family>` (moe | mla) on its tiny target (built once
    into .cache, ~1-2 min each), run once per family per session and shared by tests/integration and
    tests/engine: the background runs' result when they were started ahead, else run here."""
    import json
    import time

    runs = {}

    def run(family: str):
        if family in runs:
            return runs[family]
        if _ahead is None:
            runs[family] = run_family(family, tmp_path_factory.mktemp(f"tiny_{family}"))
            return runs[family]
        proc, out = _ahead
        result = out / f"{family}.json"
        deadline = time.time() + 3600
        while not result.exists():
            assert proc.poll() is None or result.exists(), \
                f"the background family runs stopped (exit {proc.returncode}): " \
                f"{(out / 'family_runs.log').read_text()[-4000:]}"
            assert time.time() < deadline, f"the background tiny_{family} run took over an hour"
            time.sleep(2)
        r = json.loads(result.read_text())
        assert r["ok"], f"recipe=tiny_{family} failed in the background:\n{r['error']}"
        runs[family] = (Path(r["run"]), Path(r["log"]).read_text())
        return runs[family]

    return run


@pytest.fixture(scope="session")
def random_tiny_target(tmp_path_factory):
    """Path of an untrained Llama of the tiny target's shape with its tokenizer (seconds), for tests of
    mechanics that do not need a learned target."""
    return tiny_writer.save_random_target(tmp_path_factory.mktemp("random_tiny_target"))


@pytest.fixture(scope="module")
def slurm_cluster(request):
    """A private Slurm cluster on this machine (tests/helpers/slurm_cluster.py: munged, slurmctld, slurmd n1 and
    n2 in partition ``cpu``), up for the module that asks for it and stopped after it, jobs and all. Its config,
    state and daemon logs live in a fresh /tmp/fledge-slurm-* directory (munged refuses a socket under
    pytest's private temp dir), removed afterwards unless a test failed (then its path is printed)."""
    failed = request.session.testsfailed
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="fledge-slurm-", dir="/tmp")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        if request.session.testsfailed > failed:
            print(f"\nslurm_cluster: daemon logs kept in {cluster.root}")
        else:
            shutil.rmtree(cluster.root, ignore_errors=True)
