"""Ending a long command cleanly on SIGINT, SIGTERM and SIGHUP (Ctrl-C, `kill`, a closed terminal or ssh session).

Inside :func:`stop_on_signals` the first of them raises :class:`Stopped` in the main thread, as Ctrl-C raises
KeyboardInterrupt: ``finally`` blocks and ``with`` exits then end the command's children and keep its finished
work. Later signals are ignored, so that cleanup is never cut short by an impatient second Ctrl-C. A cleanup that
also runs on the normal path (a server stopped after the work is done) goes inside :func:`deferred`: a signal that
arrives there raises only at its end. The command exits ``128 + signal number`` (:attr:`Stopped.exit_code`), the
shells' convention.

    with stop_on_signals():
        try:
            work()
        except Stopped as e:
            print(f"...: stopped by {e.name}; rerun to resume", file=sys.stderr)
            return e.exit_code
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = {"installed": False, "stopped": False, "deferring": 0, "pending": None, "holding": 0}


class Stopped(BaseException):
    """A stop signal arrived (BaseException, as KeyboardInterrupt: ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {self.name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame) -> None:
    if _state["stopped"]:
        return  # already stopping: the cleanup runs to its end
    if _state["holding"]:
        _state["stopped"] = True  # the block in held() stops at a boundary of its own
        return
    if _state["deferring"]:
        _state["pending"] = _state["pending"] or signum
        return
    _state["stopped"] = True
    raise Stopped(signum)


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Raise :class:`Stopped` at the first of ``signals`` (main thread only; elsewhere a no-op), the previous
    handlers back afterwards."""
    if threading.current_thread() is not threading.main_thread() or _state["installed"]:
        yield
        return
    _state.update(installed=True, stopped=False, deferring=0, pending=None)
    old = {s: signal.signal(s, _handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _state.update(installed=False, stopped=False, deferring=0, pending=None)


@contextmanager
def deferred() -> Iterator[None]:
    """A block no stop signal interrupts: one arriving inside raises :class:`Stopped` at its end."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
        pending = _state["pending"]
        if not _state["deferring"] and pending and not _state["stopped"]:
            _state.update(stopped=True, pending=None)
            raise Stopped(pending)


@contextmanager
def held(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """A block that stops at boundaries of its own (a trainer's step, where it checkpoints): a stop signal
    arriving inside raises nothing, now or at the block's end; :func:`stopping` turns true, the block ends its
    work itself, and later signals are ignored. Holds ``signals`` for the block when :func:`stop_on_signals`
    does not already."""
    with stop_on_signals(signals):
        _state["holding"] += 1
        try:
            yield
        finally:
            _state["holding"] -= 1


def stopping() -> bool:
    """Whether a stop signal has arrived (for loops in other threads, which never see :class:`Stopped`)."""
    return bool(_state["stopped"] or _state["pending"])
