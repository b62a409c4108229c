"""Progress of a long loop, for a person at a terminal and for a log file alike.

On a terminal (stderr a tty) :func:`progress` is tqdm's bar. In a log (a Slurm job's output, a pipe, a file) a bar
is carriage-return updates that pile up as one line of tens of KB, so there it is one plain line every
``FLEDGE_PROGRESS_S`` seconds (30 by default) and one when the loop ends. Every loop of Fledge that shows progress
goes through :func:`progress`; :func:`quiet_library_bars` turns off the bars of the libraries Fledge calls
(datasets' map, the Hub's downloads, transformers' loading) when stderr is a log.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

DEFAULT_INTERVAL_S = 30.0


def interval_s() -> float:
    """Seconds between two progress lines in a log: ``FLEDGE_PROGRESS_S``, else 30."""
    return float(os.environ.get("FLEDGE_PROGRESS_S", DEFAULT_INTERVAL_S))


def is_terminal(stream: IO | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", initial: float = 0,
             unit: str = "it", unit_scale: bool = False, disable: bool = False, leave: bool = True):
    """tqdm's bar on a terminal, a :class:`LineProgress` in a log; both iterate ``iterable`` or take
    ``update(n)``, ``set_postfix(**values)`` and ``close()``."""
    if is_terminal():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, initial=initial, unit=unit, unit_scale=unit_scale,
                    disable=disable, leave=leave, dynamic_ncols=True)
    return LineProgress(iterable, total=total, desc=desc, initial=initial, unit=unit, unit_scale=unit_scale,
                        disable=disable)


class LineProgress:
    """Plain progress lines, ``desc: n/total unit (p%), rate, elapsed, left, postfix``: one every ``every_s``
    seconds while the loop runs and one at its end (none when disabled or when nothing was done)."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
                 initial: float = 0, unit: str = "it", unit_scale: bool = False, disable: bool = False,
                 every_s: float | None = None, file: IO | None = None, clock: Callable[[], float] = time.monotonic):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit, self.unit_scale = iterable, total, desc, unit, unit_scale
        self.n = self.start_n = self.shown_n = initial
        self.disable, self.file, self.clock = disable, file, clock
        self.every_s = interval_s() if every_s is None else every_s
        self.start = self.last = clock()
        self.postfix, self.closed = "", False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.every_s:
            self._show(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed and self.n != self.shown_n:
            self._show(self.clock())
        self.closed = True

    def _amount(self, x: float) -> str:
        if self.unit_scale:
            from tqdm import tqdm

            return tqdm.format_sizeof(x)
        return str(int(x)) if float(x).is_integer() else f"{x:.3g}"

    def line(self, now: float) -> str:
        from tqdm import tqdm

        elapsed = now - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        done = f"{self._amount(self.n)}/{self._amount(self.total)} {self.unit}" if self.total else \
            f"{self._amount(self.n)} {self.unit}"
        parts = [f"{done} ({100 * self.n / self.total:.0f}%)" if self.total else done,
                 f"{self._amount(rate)} {self.unit}/s", f"{tqdm.format_interval(elapsed)} elapsed"]
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"{tqdm.format_interval((self.total - self.n) / rate)} left")
        if self.postfix:
            parts.append(self.postfix)
        return f"{self.desc}: " * bool(self.desc) + ", ".join(parts)

    def _show(self, now: float) -> None:
        self.last, self.shown_n = now, self.n
        if not self.disable:
            print(self.line(now), file=self.file or sys.stderr, flush=True)


def quiet_library_bars() -> None:
    """In a log, the bars of datasets, huggingface_hub and transformers are off: through their variables,
    which a user's own setting beats, for what imports them later (the engine processes too, whose logs are
    files), and through their switches for what has imported them already."""
    if is_terminal():
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
