"""What to run when a testbed path is missing: the ``fledge tiny-target`` command that writes it.

The pipeline asks here before any stage runs (pipeline/preflight.py, pipeline/stages.py's checks), so a tiny
recipe run before its target is built fails with the build command; no library below tests paths for the
testbed's names. The layout is testbed/tiny_target.py's (under ``.cache/tiny_target``): ``llama/``, ``moe/``,
``mla/`` and ``long/`` targets, ``data/`` and ``tokenizer/`` (written by any build), ``long_data/`` and
``long_eval/`` (the long target's).
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
    name = {"moe": "moe", "mla": "mla", "long": "long", "long_data": "long", "long_eval": "long"}.get(top)
    return f"build it with `fledge tiny-target{f' {name}' if name else ''}`"
