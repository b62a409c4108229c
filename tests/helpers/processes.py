"""The processes a test started, for tests that kill -9 a run and check nothing is left behind."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (torchrun starts its ranks in sessions of their own: killpg misses
    them), for tests that kill -9 a run."""
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
