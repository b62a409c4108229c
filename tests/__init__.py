"""Fledge's test suite, a package: shared code in tests/helpers/, fixtures in conftest.py files (docs/testing.md)."""
