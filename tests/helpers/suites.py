"""Which suite a test belongs to: CI's (the default, under 30 minutes on 2 cores) or the full suite's
(``FLEDGE_ENGINE_FULL=1``, docs/testing.md). A test moved to the full suite has a CI twin, named in its
docstring or beside the mark, that covers the same code path more cheaply."""

import os

import pytest

FULL_ONLY = pytest.mark.skipif(os.environ.get("FLEDGE_ENGINE_FULL") != "1",
                               reason="the full suite's (FLEDGE_ENGINE_FULL=1): CI's 30 minutes")
