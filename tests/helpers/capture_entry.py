"""torchrun entry (``-m tests.helpers.capture_entry``) for tests/distributed/test_capture_resume.py: train/main.py,
with each target forward slowed down by FLEDGE_TEST_SLOW seconds (so the test can kill -9 the run in the middle of the
capture)."""

import os
import time

import fledge.data.capture.offline as capture
from fledge.train import main

_delay = float(os.environ.get("FLEDGE_TEST_SLOW", "0"))
if _delay:
    _rows = capture.capture_rows

    def _slow_rows(*args, **kwargs):
        time.sleep(_delay)
        return _rows(*args, **kwargs)

    capture.capture_rows = _slow_rows

if __name__ == "__main__":
    main.main()
