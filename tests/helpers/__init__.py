"""Code the tests share, imported as modules (``from tests.helpers.models import make_drafter``): fixtures
live in conftest.py files, never here, and no test module imports another."""
