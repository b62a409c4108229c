"""The README is a short entry point and docs/ holds the manual: every page is linked from the README, every
relative link resolves, and the code cites files a reader has (docs/testing.md)."""

import re

import pytest

from tests.helpers.paths import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
ROOMS = ("fledge", "conf", "models", "data", "serving", "evaluation", "testbed", "train", "pipeline", "scripts",
         "tests")
TOP = ROOMS + ("recipes", "docs")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A path of this repository as prose cites it: a top-level folder, then folders, then a file with a suffix.
CITED = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./-]*\w\.(?:py|md|sh|yaml|sbatch|json|lock|toml))\b")


def _exists(cited: str) -> bool:
    """``cited`` is a file of the repository, or one as installed (fledge/serving/export.py is serving/export.py)."""
    installed = cited.split("/", 1)[1] if cited.startswith("fledge/") else None
    return (REPO / cited).exists() or bool(installed and installed.split("/")[0] in TOP and (REPO / installed).exists())


def _source_files():
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*")):
            if path.suffix in (".py", ".sh", ".sbatch", ".yaml") and "fixtures" not in path.parts \
                    and "__pycache__" not in path.parts:
                yield path


def test_the_readme_is_under_8_kb():
    """The README is the front door: what Fledge is, the two commands, headline figures with links; measurements
    live in docs/performance.md and the recipe cards, beside their script, machine and date."""
    assert README.stat().st_size < 8 * 1024, f"README.md is {README.stat().st_size} bytes: move detail to docs/"


def test_every_docs_page_is_linked_from_the_readme():
    assert DOCS, "no docs/ pages"
    linked = {(README.parent / target).resolve() for target in LINK.findall(README.read_text())}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = [t for t in LINK.findall(page.read_text())
              if "://" not in t and not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_docs_cite_files_that_exist(page):
    missing = sorted({p for p in CITED.findall(page.read_text()) if not (REPO / p).exists()})
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"


def test_the_code_cites_files_that_exist_and_no_reference_sheets_or_issue_numbers():
    """A docstring or comment points a reader at a file of this repository (a module, a docs page), never at
    notes a user does not have (SPEC.md, DESIGN.md) or an issue tracker's numbers."""
    offenders = []
    for path in _source_files():
        if path.name in ("test_docs.py",):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{n}"
            if re.search(r"\bSPEC(\.md)?\b( section| \d)|\bDESIGN\.md\b|\bissues? #?\d+", line):
                offenders.append(f"{where}: {line.strip()[:100]}")
            offenders += [f"{where}: {p} does not exist" for p in CITED.findall(line) if not _exists(p)]
    assert not offenders, "\n".join(offenders)
