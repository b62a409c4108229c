"""The serving engine (.engine/venv, scripts/setup_engine.sh) for the tests that need it."""

from __future__ import annotations

import os

import pytest

from fledge.engine_process import engine_python


def engine_marks() -> list:
    """pytestmark of a module that needs the serving engine (.engine/venv): skipped where it is missing on a
    developer's machine; a missing engine fails collection under CI=true or FLEDGE_ENGINE=1, unless
    FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI."""
    engine = engine_python()
    missing = f"no serving engine at {engine} (bash scripts/setup_engine.sh)"
    required = os.environ.get("FLEDGE_ENGINE") == "1" or (
        os.environ.get("CI") == "true" and os.environ.get("FLEDGE_ENGINE_OPTIONAL") != "1")
    if not engine.exists() and required:
        pytest.fail(f"{missing}; CI (or FLEDGE_ENGINE=1) requires the serving engine "
                    "(FLEDGE_ENGINE_OPTIONAL=1 for an offline CI)", pytrace=False)
    return [pytest.mark.skipif(not engine.exists(), reason=missing), pytest.mark.slow]
