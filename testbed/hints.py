"""What to run when a testbed path is missing: the ``fledge tiny-target`` command that writes it.

The pipeline asks here before any stage runs (train/preflight.py, train/pipeline.py's checks), so a tiny
recipe run before its target is built fails with the build command; no library below tests paths for the
testbed's names. The layout is testbed/tiny_target.py's (under ``.cache/tiny_target``): ``<budget>/`` and
``<family>-<budget>/`` targets, ``data/``, ``long_data/`` (the long budget's) and ``long_eval/``.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

CACHE = "tiny_target"  # testbed/tiny_target.py default_root(): .cache/tiny_target


def build_hint(path: str) -> str:
    """"build it with `fledge tiny-target ...`" for a path inside the testbed's cache, else ""."""
    parts = PurePosixPath(Path(path).as_posix()).parts
    if CACHE not in parts:
        return ""
    below = parts[parts.index(CACHE) + 1:]
    top = below[0] if below else ""
    if top == "long_data":
        return "build it with `fledge tiny-target --budget long`"
    if top in ("", "data", "long_eval", "tokenizer"):  # written by any build
        return "build it with `fledge tiny-target`"
    family, _, budget = top.rpartition("-")
    return f"build it with `fledge tiny-target --budget {budget}{f' --family {family}' if family else ''}`"
