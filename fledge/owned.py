"""What Fledge may delete: the one guard every path that deletes or replaces a directory goes through.

Fledge deletes only what it wrote, unless the user asked for it by name (a ``--force``):

- an output directory :func:`fledge.atomic.atomic_path` wrote carries :data:`MARK`, a JSON record of its kind
  (``import-gguf``, ``tiny-target``, ``export``, ``drafter-checkpoint``...) and of the exact files written; it
  is replaced only by a writer of the same kind, and only while it holds no file outside that list;
- anything inside a run's stage directory (one whose ``manifest.json`` names it: the runner made it) is the
  run's own: its stages replace, resume and start it over (unless it records another writer's kind: an
  ``import-gguf --out`` pointed at a run's ``best/`` is refused);
- a missing or empty directory, or a symlink (removing a link deletes nothing behind it), loses nothing.

Anything else is refused with :class:`NotOwned`: one line naming the directory, files of it that Fledge did
not write, and the fix the caller gives. Run names that would leave ``run.output_root`` are refused by the
run layout (fledge/run_layout.py), before any of this is asked.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fledge.run_layout import MANIFEST

MARK = ".fledge-output"  # no .json suffix: a target's fingerprint (models/target.py) hashes *.json files
DEFAULT_FIX = "move those files away or write elsewhere (Fledge replaces only directories it wrote)"


class NotOwned(ValueError):
    """A directory Fledge was about to replace or delete holds files it did not write (one line)."""


def mark(directory: str | Path, kind: str) -> None:
    """Record in ``directory`` that Fledge's ``kind`` wrote it and every file it holds now."""
    d = Path(directory)
    files = sorted(str(f) for f in _files(d) if str(f) != MARK)
    (d / MARK).write_text(json.dumps({"fledge": kind, "files": files}, indent=1) + "\n")


def foreign(path: str | Path, kind: str, limit: int = 3) -> list[str]:
    """Up to ``limit`` files under ``path`` (relative to it) that neither ``kind``'s record nor a run's stage
    directory accounts for: [] when replacing or deleting ``path`` loses nothing Fledge did not write."""
    p = Path(path)
    if p.is_symlink() or not p.exists():
        return []
    if not p.is_dir():
        return [p.name]
    recorded, written = _record(p)
    if in_run_stage(p) and recorded in (None, kind):  # the run's own (an older Fledge wrote no record)
        return []
    if recorded != kind:
        written = set()
    out = []
    for f in _files(p):
        if str(f) != MARK and str(f) not in written:
            out.append(str(f))
            if len(out) >= limit:
                break
    return out


def check_replaceable(path: str | Path, kind: str, fix: str = DEFAULT_FIX) -> None:
    """NotOwned unless replacing ``path`` with ``kind``'s output loses nothing Fledge did not write."""
    found = foreign(path, kind)
    if found:
        raise NotOwned(f"{path} exists and was not written by Fledge's {kind} (it holds "
                       f"{', '.join(found)}{', ...' if len(found) >= 3 else ''}); {fix}")


def remove_owned(path: str | Path, kind: str, fix: str = DEFAULT_FIX, force: bool = False) -> None:
    """Delete ``path`` (a symlink: the link only) when it is Fledge's (see :func:`foreign`) or ``force``
    (the user asked by name); else NotOwned, and nothing is deleted."""
    p = Path(path)
    if not force:
        check_replaceable(p, kind, fix)
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def in_run_stage(path: str | Path) -> bool:
    """``path`` is a run's stage directory or lies inside one: a directory whose manifest names it."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        m = d / MANIFEST
        if m.is_file():
            try:
                if json.loads(m.read_text()).get("stage") == d.name:
                    return True
            except (ValueError, AttributeError, OSError):
                pass
    return False


def _record(d: Path) -> tuple[str | None, set[str]]:
    """The kind and the files of the record in ``d`` ((None, empty) without a readable one)."""
    try:
        rec = json.loads((d / MARK).read_text())
    except (OSError, ValueError):
        return None, set()
    if not isinstance(rec, dict) or not isinstance(rec.get("fledge"), str) or not isinstance(rec.get("files"), list):
        return None, set()
    return rec["fledge"], {f for f in rec["files"] if isinstance(f, str)}


def _files(d: Path):
    """Every file and symlink under ``d``, relative to it (symlinked directories are not followed)."""
    for root, dirs, files in os.walk(d):
        rel = Path(root).relative_to(d)
        for name in files + [x for x in dirs if (Path(root) / x).is_symlink()]:
            yield rel / name
