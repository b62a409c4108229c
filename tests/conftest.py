"""Shared test setup: offline, deterministic, CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip_gpu)


def _tiny_target_script():
    """scripts/ is not a package: load make_tiny_target.py by path (once per session)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "make_tiny_target"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_target.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny_target_script():
    """The scripts/make_tiny_target.py module (build_tiny_target, build_data, build_tokenizer, ...)."""
    return _tiny_target_script()


@pytest.fixture(scope="session")
def tiny_target():
    """Path of the quick tiny target (a trained Llama + chat tokenizer), built once into .cache (~2 min)."""
    return _tiny_target_script().build_tiny_target("quick")


@pytest.fixture(scope="session")
def tiny_data():
    """Path of the tiny recipe's data dir (train.jsonl, eval.jsonl), built once into .cache (seconds)."""
    return _tiny_target_script().build_data()


@pytest.fixture(scope="session")
def random_tiny_target(tmp_path_factory):
    """Path of an untrained Llama of the tiny target's shape with its tokenizer (seconds), for tests of
    mechanics that do not need a learned target."""
    return _tiny_target_script().save_random_target(tmp_path_factory.mktemp("random_tiny_target"))
