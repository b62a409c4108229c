"""Where the repository and the test fixtures are, for tests that read files or run commands in the checkout."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
