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
from tests.helpers.recipe_runs import run_named  # noqa: E402
from tests.helpers.slurm_cluster import LocalSlurm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# The suite's own process computes on one thread (the commands it runs set their own: OMP_NUM_THREADS=1 for the
# runs). Its tensors are tiny: an intra-op parallel region costs more than it saves, and while the session's
# background work holds the other core (the tiny target's build, the shared recipe runs) every region waits for a
# thread that is not running: tests/unit/evaluation/test_speculative.py took 222 s on torch's default two threads
# and 15 s on one, back to back on a loaded 2-core Xeon (2026-12-06; docs/testing.md).
torch.set_num_threads(1)


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
    # Inside a group, tests/distributed (two ranks on the two cores) after the rest (mostly one process), so the
    # background runs take the cores the single-process tests leave idle rather than contend with the ranks.
    items.sort(key=lambda item: (group[item.nodeid.split("::")[0]], item.nodeid.startswith("tests/distributed/")))


# The session's end-to-end runs (tests/helpers/recipe_runs.py RUNS), by the fixture that waits for each.
BACKGROUND = {"tiny_recipe_run": ("tiny",), "real_smoke_run": ("smollm2",), "tiny_family_run": ("moe", "mla")}


def _fixtures(item) -> set[str]:
    """The fixtures ``item`` uses, directly or through others; none when it is skipped."""
    skipped = any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
                  for m in item.iter_markers())
    return set() if skipped else set(getattr(item, "fixturenames", ()))


def _needs(item) -> int:
    """0: no trained tiny target (or the test is skipped); 1: the tiny Llama (``tiny_target``, directly or through
    a fixture); 2: an end-to-end run made in the background (BACKGROUND): these modules run last, so the runs have
    the whole session's idle cores."""
    names = _fixtures(item)
    return 2 if names & set(BACKGROUND) else 1 if "tiny_target" in names else 0


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
def tiny_recipe_run(background_run):
    """(run dir, log) of the README's main command, `recipe=tiny`, run once per session (in the background from
    its start: _ahead) and shared by tests/integration (the golden figures) and tests/engine (vLLM serves its
    export; tests/helpers/recipe_runs.py)."""
    return background_run("tiny")


@pytest.fixture(scope="session")
def real_smoke_run(background_run):
    """(run dir, log) of recipe=smollm2's stages in small on the real target (tests/helpers/recipe_runs.py
    run_real_smoke; tests/engine/test_real_target.py), run once per session in the background from its start."""
    return background_run("smollm2")


def _session_root(tmp_path_factory) -> Path:
    """The session's temp root, the same for every xdist worker (each has its own basetemp, popen-gwN, in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _ahead(request, tmp_path_factory):
    """Start what the session's tests will wait for, in the background, as the session starts: the tiny
    Llama's build (`fledge tiny-target`, ~4 min on 2 cores in CI) while the modules that need no trained target
    run (pytest_collection_modifyitems orders them first; the ``tiny_target`` fixture then waits on the build's
    lock), and the end-to-end runs the session's tests use (BACKGROUND; tests/helpers/recipe_runs.py) one after
    another at the lowest CPU priority, on the cores the rest of the suite leaves idle; the modules that use them
    run last. FLEDGE_AHEAD=0 builds and runs each in the foreground when first needed. Under xdist the first
    worker to arrive starts them and the others wait on the same files.
    Yields None or (the background's output dir, the runs it makes)."""
    import signal
    import subprocess
    import sys

    used = set().union(*(_fixtures(item) for item in request.session.items))
    runs = [run for fixture, names in BACKGROUND.items() if fixture in used for run in names]
    needs = {_needs(item) for item in request.session.items}
    if os.environ.get("FLEDGE_AHEAD") == "0" or not needs - {0}:
        yield None
        return
    out = _session_root(tmp_path_factory) / "ahead"
    try:
        out.mkdir()  # atomic: one starter per session
    except FileExistsError:
        yield (out, runs) if runs else None
        return
    root, procs = REPO, []
    if needs & {1} or "tiny" in runs:
        with open(out / "tiny_target.log", "w") as log:
            # one thread, as scripts/test.sh builds it and recipes/tiny/golden.json was measured
            procs.append(subprocess.Popen([sys.executable, "-m", "fledge", "tiny-target"], cwd=root, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
    if runs:
        # the real target's smoke first: it needs no tiny target, which is still building
        runs.sort(key=lambda run: run != "smollm2")
        with open(out / "background_runs.log", "w") as log:
            # background.exit: its exit status, for whoever waits on a run it did not write
            procs.append(subprocess.Popen(
                ["sh", "-c", '"$0" -m tests.helpers.recipe_runs "$@"; echo $? > "$1/background.exit"',
                 sys.executable, str(out), *runs],
                cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "FLEDGE_BACKGROUND_NICE": "0" if os.environ.get("PYTEST_XDIST_WORKER") else "19"}))
    yield (out, runs) if runs else None
    if os.environ.get("PYTEST_XDIST_WORKER") and not request.session.shouldstop:
        for proc in procs:  # other workers may still wait on them
            proc.wait()
    for proc in procs:  # the session ended early (-x, a subset): stop what is left, ranks and engines included
        if proc.poll() is None:
            for pid in descendants(proc.pid) + [proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="session")
def background_run(tmp_path_factory, _ahead):
    """``run(name)`` -> (run dir, log) of one of tests/helpers/recipe_runs.py's RUNS, made once per session: the
    background run's result when _ahead started it, else run here."""
    import json
    import time

    done = {}

    def run(name: str):
        if name in done:
            return done[name]
        if _ahead is None or name not in _ahead[1]:
            done[name] = run_named(name, tmp_path_factory.mktemp(f"run_{name}"))
            return done[name]
        out = _ahead[0]
        result, ended = out / f"{name}.json", out / "background.exit"
        deadline = time.time() + 3600
        while not result.exists():
            assert not ended.exists() or result.exists(), \
                f"the background runs stopped (exit {ended.read_text().strip()}): " \
                f"{(out / 'background_runs.log').read_text()[-4000:]}"
            assert time.time() < deadline, f"the background {name} run took over an hour"
            time.sleep(2)
        r = json.loads(result.read_text())
        assert r["ok"], f"the {name} run failed in the background:\n{r['error']}"
        done[name] = (Path(r["run"]), Path(r["log"]).read_text())
        return done[name]

    return run


@pytest.fixture(scope="session")
def tiny_family_run(background_run):
    """``run(family)`` -> (run dir, log) of `recipe=tiny_<family>` (moe | mla) on its tiny target (built once
    into .cache, ~1-2 min each), run once per family per session and shared by tests/integration and
    tests/engine."""
    return background_run


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
