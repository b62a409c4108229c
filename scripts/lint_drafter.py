"""Lint an exported drafter against its target: ``python scripts/lint_drafter.py DIR [--target T | --recipe R]``.

Prints each finding with its fix; exits 1 when there is an error, 0 otherwise (warnings only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.lint import format_findings, has_errors, lint_drafter, resolve_target_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter_dir")
    ap.add_argument("--target", help="target: local dir, config.json, or hub id (default: from the export)")
    ap.add_argument("--recipe", help="take the target's config from conf/recipe/<name>.yaml")
    args = ap.parse_args(argv)
    target = resolve_target_config(args.target, args.recipe, args.drafter_dir)
    if target is None:
        print("note: no target config given or recorded; skipping the checks against the target")
    findings = lint_drafter(args.drafter_dir, target)
    for line in format_findings(findings):
        print(line)
    errors = sum(f.level == "error" for f in findings)
    print(f"{args.drafter_dir}: {errors} error(s), {len(findings) - errors} warning(s)")
    return 1 if has_errors(findings) else 0


if __name__ == "__main__":
    sys.exit(main())
