"""Shared test setup: offline, deterministic, CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import fledge.data.tiny_target as tiny_target_builder  # noqa: E402
from fledge.conf.schema import DrafterConfig  # noqa: E402
from fledge.data.batch import FeatureBatch  # noqa: E402
from fledge.models.drafter import DrafterSpec, Eagle3Drafter  # noqa: E402
from recipe_runs import run_family, run_recipe  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip_gpu)
    # The trained tiny targets and the family recipe runs start in the background with the session (_ahead):
    # modules that need none of them run first, then those that need the quick tiny Llama, then the family runs'.
    group: dict[str, int] = {}
    for item in items:
        group[item.nodeid.split("::")[0]] = max(group.get(item.nodeid.split("::")[0], 0), _needs(item))
    items.sort(key=lambda item: group[item.nodeid.split("::")[0]])


def _needs(item) -> int:
    """0: no trained tiny target; 1: the quick tiny Llama (``tiny_target``, directly or through a fixture);
    2: a tiny family run (``tiny_family_run``)."""
    names = set(getattr(item, "fixturenames", ()))
    return 2 if "tiny_family_run" in names else 1 if "tiny_target" in names else 0


@pytest.fixture(scope="session")
def tiny_target_script():
    """The fledge.data.tiny_target module (build_tiny_target, build_data, build_tokenizer, ...)."""
    return tiny_target_builder


@pytest.fixture(scope="session")
def tiny_target():
    """Path of the quick tiny target (a trained Llama + chat tokenizer), built once into .cache (~7 min on 2 cores;
    a session that needs it starts the build in the background as it begins: _ahead)."""
    return tiny_target_builder.build_tiny_target("quick")


@pytest.fixture(scope="session")
def tiny_data():
    """Path of the tiny recipe's data dir (train.jsonl, eval.jsonl), built once into .cache (seconds)."""
    return tiny_target_builder.build_data()


@pytest.fixture(scope="session")
def tiny_recipe_run(tmp_path_factory, tiny_target):
    """(run dir, log) of the README's main command, `recipe=tiny`, run once per session and shared by
    tests/integration (the golden figures) and tests/engine (vLLM serves its export; tests/recipe_runs.py)."""
    return run_recipe("tiny", tiny_target, tmp_path_factory.mktemp("tiny_recipe"))


FAMILIES = ("moe", "mla")


@pytest.fixture(scope="session", autouse=True)
def _ahead(request, tmp_path_factory):
    """Start what the session's tests will wait for, in the background, as the session starts: the quick tiny
    Llama's build (`fledge tiny-target`, ~7 min on 2 cores in CI) while the modules that need no trained target
    run (pytest_collection_modifyitems orders them first; the ``tiny_target`` fixture then waits on the build's
    lock), and both tiny family runs (tests/recipe_runs.py) at the lowest CPU priority, on the cores the rest
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
    root, procs = Path(__file__).resolve().parents[1], []
    if needs & {1}:
        with open(out / "tiny_target.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "fledge", "tiny-target", "--budget", "quick"], cwd=root,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    family = None
    if needs & {2}:
        with open(out / "family_runs.log", "w") as log:
            family = subprocess.Popen([sys.executable, str(root / "tests" / "recipe_runs.py"), str(out), *FAMILIES],
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
                f"the background family runs stopped (exit {proc.returncode}): {(out / 'family_runs.log').read_text()[-4000:]}"
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
    return tiny_target_builder.save_random_target(tmp_path_factory.mktemp("random_tiny_target"))


# ---- shared helpers (import them as ``from conftest import ...``) -------------------------------------

FLAGS = {
    "eagle3": dict(fc_norm=False, norm_output=False),
    "eagle31": dict(fc_norm=True, norm_output=True),
    "norm_before_fc": dict(fc_norm=False, norm_output=False, norm_before_fc=True),
}


def target_config(**rope):
    return LlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6,
        vocab_size=50, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )


def make_drafter(seed=0, attention="sdpa", **flags):
    torch.manual_seed(seed)
    spec = DrafterSpec.from_target_config(target_config(), DrafterConfig(draft_vocab_size=40, **flags), [2, 3, 4])
    d = Eagle3Drafter(spec, attention=attention)
    with torch.no_grad():  # non-trivial norm weights so a skipped norm is visible
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name or "input_norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def packed_batch(seed=1, T=19, H=32, n_aux=3):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 9 + [1] * 8 + [-1] * 2, [0] * T])
    pos = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        for t in range(1, T):
            pos[b, t] = pos[b, t - 1] + 1 if doc[b, t] == doc[b, t - 1] else 0
    B = doc.shape[0]
    return FeatureBatch(
        input_ids=torch.randint(0, 50, (B, T), generator=g),
        loss_mask=torch.rand(B, T, generator=g) > 0.2,
        aux_hidden=torch.randn(B, T, n_aux * H, generator=g),
        target_hidden=torch.randn(B, T, H, generator=g),
        target_argmax=torch.randint(0, 40, (B, T), generator=g),
        position_ids=pos,
        document_ids=doc.int(),
    )


def random_llama(seed=0, vocab_size=96):
    """An untrained 6-layer Llama (hidden 32, GQA) for speculative-decoding mechanics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def random_drafter(target, norm_output=True, seed=1, vd=64, layer="auto"):
    """An Eagle3Drafter (layer kind ``layer``) with random weights (norms too) and a random draft vocab of ``vd`` ids."""
    v = target.config.vocab_size
    flags = SimpleNamespace(fc_norm=norm_output, norm_output=norm_output, norm_before_fc=False, draft_vocab_size=vd,
                            layer=layer)
    spec = DrafterSpec.from_target_config(target.config, flags, [2, 3, 4])
    torch.manual_seed(seed)
    d = Eagle3Drafter(spec)
    for p in d.parameters():  # random weights everywhere, norms included
        if p.requires_grad:
            p.data.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    sel = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[sel] = True
    d.set_vocab(sel - torch.arange(vd), t2d)
    d.load_target_embedding(target.get_input_embeddings().weight.detach())
    return d.eval()


def random_state_dict(config: dict, seed: int = 0, include_embed: bool = True) -> dict[str, torch.Tensor]:
    """A random fp32 drafter state_dict (drafter names) matching an exported config.json of any dialect,
    with a valid random draft vocab: exercises export, lint and load without a trained drafter."""
    from fledge.models.export import from_serving_state_dict
    from fledge.models.serving_config import expected_tensors, layer_config

    g = torch.Generator().manual_seed(seed)
    c = layer_config(config)
    V, Vd = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
    floats = {name: torch.randn(shape, generator=g) * 0.05
              for name, (shape, dtype) in expected_tensors(config, include_embed=include_embed).items()
              if dtype.is_floating_point}
    sd = from_serving_state_dict(floats)
    sel = torch.randperm(V, generator=g)[:Vd].sort().values
    sd["d2t"] = sel - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    sd["t2d"] = t2d
    return sd


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (torchrun starts its ranks in sessions of their own: killpg misses
    them), for tests that kill -9 a run."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def engine_marks() -> list:
    """pytestmark of a module that needs the serving engine (.engine/venv): skipped where it is missing on a
    developer's machine; a missing engine fails collection under CI=true or FLEDGE_ENGINE=1, unless
    FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI."""
    from fledge.models.serving_engine import engine_python

    engine = engine_python()
    missing = f"no serving engine at {engine} (bash scripts/setup_engine.sh)"
    required = os.environ.get("FLEDGE_ENGINE") == "1" or (
        os.environ.get("CI") == "true" and os.environ.get("FLEDGE_ENGINE_OPTIONAL") != "1")
    if not engine.exists() and required:
        pytest.fail(f"{missing}; CI (or FLEDGE_ENGINE=1) requires the serving engine "
                    "(FLEDGE_ENGINE_OPTIONAL=1 for an offline CI)", pytrace=False)
    return [pytest.mark.skipif(not engine.exists(), reason=missing), pytest.mark.slow]


def slurm_marks() -> list:
    """pytestmark of a module that submits real Slurm jobs (the ``slurm_cluster`` fixture): marked ``slurm`` (run
    them alone with ``-m slurm``) and ``slow``; skipped where Slurm is not installed on a developer's machine; a
    missing Slurm fails collection under CI=true or FLEDGE_SLURM=1, unless FLEDGE_SLURM_OPTIONAL=1 marks a CI
    that cannot install it (scripts/setup_slurm.sh)."""
    from slurm_cluster import missing_programs

    missing = missing_programs()
    reason = f"Slurm is not installed (missing {', '.join(missing)}: bash scripts/setup_slurm.sh)"
    required = os.environ.get("FLEDGE_SLURM") == "1" or (
        os.environ.get("CI") == "true" and os.environ.get("FLEDGE_SLURM_OPTIONAL") != "1")
    if missing and required:
        pytest.fail(f"{reason}; CI (or FLEDGE_SLURM=1) requires it (FLEDGE_SLURM_OPTIONAL=1 for a CI without "
                    "root or apt-get)", pytrace=False)
    return [pytest.mark.skipif(bool(missing), reason=reason), pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm_cluster(request):
    """A private Slurm cluster on this machine (tests/slurm_cluster.py: munged, slurmctld, slurmd n1 and n2 in
    partition ``cpu``), up for the module that asks for it and stopped after it, jobs and all. Its config,
    state and daemon logs live in a fresh /tmp/fledge-slurm-* directory (munged refuses a socket under
    pytest's private temp dir), removed afterwards unless a test failed (then its path is printed)."""
    import shutil
    import tempfile

    from slurm_cluster import LocalSlurm

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


# A small Llama target config and drafter settings for the model-card and Hub tests.
CARD_TARGET = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "vocab_size": 256, "rope_theta": 10000.0,
}
CARD_SPEC = {"fc_norm": True, "norm_output": True, "norm_before_fc": False, "aux_layer_ids": [2, 3, 4],
        "draft_vocab_size": 64, "vocab_size": 256, "max_position_embeddings": 1024}
