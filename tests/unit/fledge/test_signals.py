"""fledge/signals.py: the first stop signal raises Stopped, later ones wait for the cleanup, a deferred block is
never cut in two, and the previous handlers come back."""

import os
import signal

import pytest

from fledge import signals


def test_the_first_signal_raises_later_ones_are_ignored_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(signals.Stopped) as e, signals.stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            pytest.fail("no Stopped raised")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # during the cleanup: ignored
            assert signals.stopping()
    assert e.value.signum == signal.SIGHUP and e.value.exit_code == 129 and e.value.name == "SIGHUP"
    assert signal.getsignal(signal.SIGTERM) is before and not signals.stopping()


def test_a_signal_inside_deferred_raises_at_its_end():
    done = []
    with pytest.raises(signals.Stopped) as e, signals.stop_on_signals():
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("cleanup ran whole")
    assert done == ["cleanup ran whole"] and e.value.exit_code == 130
