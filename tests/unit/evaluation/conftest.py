"""The eval stage's test run, made once per module (tests/helpers/evaluation.py)."""

import pytest

from tests.helpers.evaluation import make_eval_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A random tiny target, a random export of it and a prepared run dir: the path holding them."""
    return make_eval_run(tmp_path_factory.mktemp("evalrun"))
