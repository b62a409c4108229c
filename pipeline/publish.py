"""What a run measured about its export, handed to the model card: the publish stage's work and ``fledge push``.

The card (serving/card.py) shows acceptance figures only from an eval of the very export it is for: the eval
stage complete, its report naming this export, and not older than the export it read (each manifest records
the id of every output its stage read; an export made again since replaced the one measured). This module
reads those manifests and the report from the run's layout (fledge/run_layout.py) and gives the card their
content, so nothing below the pipeline reads the pipeline's files.

    fledge push DIR ORG/NAME [--run-dir RUN] [--public]   upload with a card (token from HF_TOKEN)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fledge.atomic import read_json
from fledge.engine_process import read_request
from fledge.pipeline.preflight import check_publish
from fledge.run_layout import RunLayout
from fledge.serving.card import Measured
from fledge.serving.export import load_target_config
from fledge.serving.hub import check_online, push_to_hub
from fledge.serving.lint import resolve_target_config
from fledge.stage_inputs import PublishInputs

log = logging.getLogger(__name__)
PLOT_SUFFIXES = (".png", ".svg", ".jpg")


def measured_by_run(layout: RunLayout | None, drafter_dir: Path) -> Measured:
    """What ``layout``'s run measured of the export in ``drafter_dir`` (nothing, with a warning, when its eval
    is not of this export; nothing without a run), and the run's config."""
    if layout is None:
        return Measured()
    run_config = layout.config.read_text() if layout.config.exists() else ""
    manifest = read_json(layout.manifest("eval")) or {}
    if not manifest.get("complete"):
        return Measured(run_config=run_config)
    report = read_json(layout.eval.report_json) or {}
    measured = report.get("drafter")
    export = read_json(layout.manifest("export")) or {}
    read = manifest.get("read") or {}
    if measured and Path(measured).resolve() != Path(drafter_dir).resolve():
        why = f"it measured {measured}"
    elif "export" in read and read["export"] != export.get("output_id", ""):
        why = "the export was made again after it"
    else:
        plots = sorted(p for p in layout.eval.root.rglob("*") if p.suffix in PLOT_SUFFIXES)
        return Measured(outputs=manifest.get("outputs"), plots=plots, engine=report.get("engine"),
                        engine_request=read_request(layout.eval.engine_work), run_config=run_config)
    log.warning("model card: no acceptance figures: the eval in %s is not of %s (%s); run the eval stage on it",
                layout.eval.root, drafter_dir, why)
    return Measured(run_config=run_config)


def publish_run(inputs: PublishInputs, layout: RunLayout, drafter_dir: Path) -> dict:
    """The publish stage's work: push the export with a card of this run's eval (export.push_to_hub)."""
    ex = inputs.export
    check_publish(ex, inputs.stages)  # the token may have gone since the command started
    url = push_to_hub(drafter_dir, ex.repo_id, private=ex.private, measured=measured_by_run(layout, drafter_dir),
                      target_config=load_target_config(inputs.target), speculative_tokens=inputs.draft_tokens,
                      token=os.environ["HF_TOKEN"])
    return {"pushed": True, "repo_id": ex.repo_id, "private": ex.private, "hub_url": url}


def measured_draft_tokens(measured: Measured) -> int | None:
    """The k the run's eval served the export with (its engine section's, else the run's eval.draft_tokens): the
    card's commands then carry the speculative config the eval measured."""
    if measured.engine and measured.engine.get("k"):
        return int(measured.engine["k"])
    if not measured.run_config:
        return None
    import yaml

    k = ((yaml.safe_load(measured.run_config) or {}).get("eval") or {}).get("draft_tokens")
    return int(k) if k else None


def run_of_export(drafter_dir: Path) -> RunLayout | None:
    """The run whose export stage wrote ``drafter_dir``, when it is one's (``<run>/export/drafter``)."""
    layout = RunLayout(Path(drafter_dir).parent.parent)
    return layout if layout.export.drafter == Path(drafter_dir) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fledge push", description="Upload an exported drafter with a generated "
                                 "model card (token from HF_TOKEN, never printed).")
    ap.add_argument("drafter_dir")
    ap.add_argument("repo_id")
    ap.add_argument("--public", action="store_true", help="create a public repo (default private)")
    ap.add_argument("--run-dir", help="the run directory, for the card's eval table, plots and config")
    ap.add_argument("--target", help="target: local dir, config.json, or hub id (default: from the export)")
    ap.add_argument("--recipe", help="take the target's config from conf/recipe/<name>.yaml")
    ap.add_argument("--k", type=int, help="num_speculative_tokens in the card's serving commands (default: the "
                    "eval's eval.draft_tokens, as the run measured the export; 5 without a run)")
    ap.add_argument("--endpoint", help="Hub endpoint (default HF_ENDPOINT or huggingface.co)")
    args = ap.parse_args(argv)
    drafter = Path(args.drafter_dir)
    layout = RunLayout(args.run_dir) if args.run_dir else run_of_export(drafter)
    try:
        check_online()  # before the target is looked up on the Hub, or anything is linted
        measured = measured_by_run(layout, drafter)
        url = push_to_hub(drafter, args.repo_id, private=not args.public, measured=measured,
                          target_config=resolve_target_config(args.target, args.recipe, drafter),
                          speculative_tokens=args.k or measured_draft_tokens(measured) or 5, endpoint=args.endpoint)
    except ValueError as e:  # a HubError too: one line, the fix, no token
        print(f"fledge push: error: {e}", file=sys.stderr)
        return 2
    print(url)
    return 0
