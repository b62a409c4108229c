"""The suite is a package (docs/testing.md): shared code in tests/helpers/ imported as modules, fixtures in
conftest.py files, no test module importing another, and no subprocess handed tests/ on its PYTHONPATH."""

import ast
import re

from tests.helpers.paths import REPO

TESTS = REPO / "tests"


def _modules():
    return sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def test_every_folder_of_test_code_is_a_package():
    missing = sorted({str(p.parent.relative_to(REPO)) for p in _modules() if not (p.parent / "__init__.py").exists()})
    assert not missing, f"no __init__.py in {missing}"


def test_no_module_imports_a_test_module_or_a_conftest():
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                last = name.split(".")[-1]
                if last == "conftest" or last.startswith("test_"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not offenders, offenders


def test_conftest_files_hold_fixtures_and_hooks_only():
    offenders = []
    for path in TESTS.rglob("conftest.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith(("_", "pytest_")):
                fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
                if not fixture:
                    offenders.append(f"{path.relative_to(REPO)}: {node.name}")
    assert not offenders, f"helpers belong in tests/helpers/: {offenders}"


def test_no_subprocess_puts_tests_on_the_pythonpath():
    """A command run by a test imports the product as users do; test code reaches it as ``-m tests...``."""
    pattern = re.compile(r"PYTHONPATH[^\n]*[\"'/]tests\b")
    offenders = [str(p.relative_to(REPO)) for p in _modules() if pattern.search(p.read_text())
                 and p.name != "test_suite_layout.py"]
    assert not offenders, offenders
