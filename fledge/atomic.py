"""Atomic file and directory writes: nothing half-written is ever left under its final name.

Everything is written to a temporary sibling and renamed into place (rename is atomic on POSIX
within one filesystem), so a crash or kill -9 leaves either the old object or the new one. Files get the mode
a plain ``open`` would give them (0666 less the umask), not the temporary file's 0600. A directory replaced by
:func:`atomic_path` must be one Fledge wrote (fledge/owned.py, the one guard of what Fledge deletes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fledge.owned import DEFAULT_FIX, check_replaceable, mark


def read_json(path: str | Path) -> dict | None:
    """The JSON object at ``path``, or None when the file does not exist."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e}); delete it to start that step over") from None


def read_jsonl(path: str | Path, fix: str) -> list[dict]:
    """The records of a jsonl file (blank lines skipped); a bad line is a ValueError naming the file, the line
    and ``fix``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e}); {fix}") from None
    return out


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """``obj`` as strict JSON: a non-finite number (an AL over no rounds, an infinite log-prob gap) is
    written as null, since jq, JavaScript and most dashboards refuse the NaN / Infinity Python emits."""
    text = json.dumps(finite_or_null(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    write_bytes_atomic(path, (text + "\n").encode())


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every NaN / +-inf float (in nested dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with contextlib.suppress(OSError):  # a filesystem without modes keeps its own
            os.fchmod(fd, file_mode())  # mkstemp's 0600 would hide exports and reports from other accounts
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path, kind: str = "output", fix: str = DEFAULT_FIX,
                force: bool = False) -> Iterator[Path]:
    """Yield a temporary path (file or directory) next to ``path``; on success rename it to ``path``
    (replacing what was there), on failure remove it. A directory is marked as ``kind``'s output with the
    files it holds (fledge/owned.py); an existing directory at ``path`` is replaced only when it is Fledge's
    (``kind``'s output, or inside a run's stage directory) or ``force`` (the user asked): otherwise NotOwned,
    one line ending in ``fix``, before anything is written."""
    p = Path(path)
    if not force and p.is_dir() and not p.is_symlink():
        check_replaceable(p, kind, fix)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.tmp-{os.getpid()}"
    _remove(tmp)
    try:
        yield tmp
        _honour_umask(tmp)  # safetensors and the Hub's writers create their files 0600
        if tmp.is_dir() and not tmp.is_symlink():
            mark(tmp, kind)
        if p.is_dir() and tmp.is_dir():
            old = p.parent / f".{p.name}.old-{os.getpid()}"
            os.replace(p, old)
            os.replace(tmp, p)
            _remove(old)
        else:
            os.replace(tmp, p)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


_UMASK: list[int] = []


def umask() -> int:
    """The process umask, read once without changing it (Linux's /proc; elsewhere set and restored at once)."""
    if not _UMASK:
        try:
            with open("/proc/self/status") as f:
                _UMASK.append(next(int(line.split()[1], 8) for line in f if line.startswith("Umask:")))
        except (OSError, StopIteration, ValueError, IndexError):
            mask = os.umask(0o022)
            os.umask(mask)
            _UMASK.append(mask)
    return _UMASK[0]


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def _honour_umask(path: Path) -> None:
    """Give ``path`` and, for a directory, everything under it the modes the umask gives (0666 less it for a
    file, 0777 less it for a directory or an executable file); symlinks are left as they are."""
    def fix(p: Path) -> None:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            return
        full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o666
        with contextlib.suppress(OSError):  # a filesystem without modes keeps its own
            os.chmod(p, full & ~umask())

    if not path.exists() or path.is_symlink():
        return
    fix(path)
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                fix(Path(root) / name)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
