"""Upload an exported drafter with a generated model card:
``HF_TOKEN=... python scripts/push_to_hub.py DIR ORG/NAME [--public] [--run-dir outputs/RUN] [--recipe R]``.

The drafter is linted first and refused on errors. The token is read from HF_TOKEN (never printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.hub import push_to_hub  # noqa: E402
from models.lint import resolve_target_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter_dir")
    ap.add_argument("repo_id")
    ap.add_argument("--public", action="store_true", help="create a public repo (default private)")
    ap.add_argument("--run-dir", help="the run directory, for the card's eval table, plots and config")
    ap.add_argument("--target", help="target: local dir, config.json, or hub id (default: from the export)")
    ap.add_argument("--recipe", help="take the target's config from conf/recipe/<name>.yaml")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens in the card's serving commands")
    ap.add_argument("--endpoint", help="Hub endpoint (default HF_ENDPOINT or huggingface.co)")
    args = ap.parse_args(argv)
    drafter = Path(args.drafter_dir)
    run_dir = args.run_dir or (drafter.parent.parent if drafter.parent.name == "export" else None)
    try:
        url = push_to_hub(drafter, args.repo_id, private=not args.public, run_dir=run_dir,
                          target_config=resolve_target_config(args.target, args.recipe, drafter),
                          speculative_tokens=args.k, endpoint=args.endpoint)
    except ValueError as e:
        print(f"push_to_hub: {e}", file=sys.stderr)
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
