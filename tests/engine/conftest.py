"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from tests.helpers.mtp_target import SmallMtpTarget, train_small_mtp_target


@pytest.fixture(scope="session")
def mtp_target(tmp_path_factory) -> SmallMtpTarget:
    """A small mla_mtp target trained here with its module (tests/helpers/mtp_target.py, ~20 CPU-s), once a session."""
    return train_small_mtp_target(tmp_path_factory.mktemp("mla_mtp"))
