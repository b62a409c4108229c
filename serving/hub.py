"""Publish an exported drafter to the Hugging Face Hub with a generated model card.

The pipeline's publish stage (train/pipeline.py, after eval) and ``fledge push`` call :func:`push_to_hub`;
the card's acceptance figures come only from an eval of the very export pushed. The token comes from
``HF_TOKEN`` (``fledge push`` also takes huggingface_hub's own login) and is never printed or logged. An
export that fails the linter is refused. Transient failures (HTTP 5xx / 429, connection errors and
timeouts) are retried with exponential backoff; other errors (401, 403, 404, ...) are raised at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from fledge.atomic import read_json
from fledge.serving.dialects import dialect_of, serving_commands
from fledge.serving.card import engine_section, sglang_note
from fledge.serving.serving_config import layer_config

log = logging.getLogger(__name__)
T = TypeVar("T")
PLOT_SUFFIXES = (".png", ".svg", ".jpg")


def is_transient(exc: BaseException) -> bool:
    """5xx / 429 answers and network-level failures are worth retrying; anything else is not."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        status = getattr(exc.response, "status_code", None)
        return status is None or status >= 500 or status == 429
    try:
        import httpx2 as httpx  # huggingface_hub 2.x's HTTP client
    except ImportError:  # pragma: no cover
        import httpx
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))


def with_retries(fn: Callable[[], T], what: str, attempts: int = 5, base_delay: float = 2.0,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``fn``; on a transient error wait ``base_delay * 2**i`` seconds and try again."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - filtered just below
            if not is_transient(e) or i == attempts - 1:
                raise
            delay = base_delay * 2 ** i
            log.warning("%s: transient error (%s); retry %d/%d in %.0fs", what, type(e).__name__, i + 1,
                        attempts - 1, delay)
            sleep(delay)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------ model card


def _eval_results(run_dir: Path | None, drafter_dir: Path) -> tuple[dict | None, list[Path]]:
    """The eval stage's summary (from its manifest) and its plots, only when that eval measured this very
    export: complete, of ``drafter_dir`` (its report names it), and not older than the export it read (the
    runner's manifests record the id of each output a stage read; an export re-run since replaced it)."""
    if run_dir is None:
        return None, []
    eval_dir = Path(run_dir) / "eval"
    manifest = read_json(eval_dir / "manifest.json") or {}
    if not manifest.get("complete"):
        return None, []
    measured = (read_json(eval_dir / "report.json") or {}).get("drafter")
    export = read_json(Path(run_dir) / "export" / "manifest.json") or {}
    read = manifest.get("read") or {}
    if measured and Path(measured).resolve() != Path(drafter_dir).resolve():
        why = f"it measured {measured}"
    elif "export" in read and read["export"] != export.get("output_id", ""):
        why = "the export was made again after it"
    else:
        plots = sorted(p for p in eval_dir.rglob("*") if p.suffix in PLOT_SUFFIXES)
        return manifest.get("outputs"), plots
    log.warning("model card: no acceptance figures: the eval in %s is not of %s (%s); run the eval stage on it",
                eval_dir, drafter_dir, why)
    return None, []


def _al_table(outputs: dict) -> str:
    """A markdown table of the measured acceptance lengths: one row per eval set when the eval stage
    reports ``{"sets": {name: {...metrics}}}``, else one row of its scalar outputs."""
    sets = outputs.get("sets") if isinstance(outputs.get("sets"), dict) else {"all": outputs}
    rows = {name: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for name, m in sets.items() if isinstance(m, dict)}
    cols = sorted({k for m in rows.values() for k in m})
    if not cols:
        return ""
    lines = ["| set | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, m in rows.items():
        cells = [f"{m[c]:.3f}" if isinstance(m.get(c), float) else str(m.get(c, "")) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_model_card(drafter_dir: str | Path, repo_id: str, run_dir: str | Path | None = None,
                     speculative_tokens: int = 5, plot_prefix: str = "eval"):
    """A ``huggingface_hub.ModelCard`` for an exported drafter: target, data, training config, the eval
    stage's AL table and plots when the run has them, and the serving commands of its dialect."""
    from huggingface_hub import ModelCard, ModelCardData

    d = Path(drafter_dir)
    config = read_json(d / "config.json") or {}
    record = read_json(d / "fledge_training.json") or {}
    c = layer_config(config)
    dialect = dialect_of(config)
    target = (record.get("target") or {}).get("name_or_path") or c.get("target_name") or "<target>"
    run_cfg = _run_config_text(run_dir)
    datasets = _datasets(run_dir)
    flavour = "EAGLE-3.1" if c.get("fc_norm") or c.get("norm_output") else "EAGLE-3"
    card_data = ModelCardData(
        base_model=target if "/" in target and not Path(target).exists() else None,
        library_name="fledge", tags=["speculative-decoding", "eagle3", "drafter", flavour.lower()],
        datasets=datasets or None, pipeline_tag="text-generation")
    outputs, plots = _eval_results(Path(run_dir) if run_dir else None, d)
    parts = [
        f"# {repo_id.split('/')[-1]}\n",
        f"An {flavour} speculative-decoding drafter for **{target}**, trained with Fledge. It proposes "
        "tokens that the target verifies, so outputs are the target's own.\n",
        "## Drafter\n",
        f"- format: `{dialect.name}` ({', '.join(config.get('architectures') or [])})",
        f"- aux layers (boundary convention): `{c.get('aux_layer_ids')}`",
        f"- flags: fc_norm={bool(c.get('fc_norm'))}, norm_output={bool(c.get('norm_output'))}",
        f"- draft vocab: {c.get('draft_vocab_size')} of {c.get('vocab_size')} target tokens",
        f"- trained steps: {record.get('step')}\n",
        "## Serving\n",
        serving_commands(dialect, repo_id, target, speculative_tokens) + "\n",
        "## Measured acceptance\n",
    ]
    table = _al_table(outputs) if outputs else ""
    parts.append(table + "\n" if table else "No eval-stage results were found for this export.\n")
    engine = engine_section(Path(run_dir), repo_id) if outputs else ""  # eval.engine=vllm: what vLLM measured
    parts += ["## Measured by the serving engine\n", engine, sglang_note() + "\n"] if engine else []
    parts += [f"![{p.stem}]({plot_prefix}/{p.name})" for p in plots]
    if record.get("metrics"):
        parts += ["\n## Training metrics (held-out, offline)\n",
                  "\n".join(f"- {k}: {v}" for k, v in sorted(record["metrics"].items()))]
    if datasets:
        parts += ["\n## Data\n", "\n".join(f"- {x}" for x in datasets)]
    if run_cfg:
        parts += ["\n## Training configuration\n", f"```yaml\n{run_cfg}\n```"]
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(parts) + "\n"
    return ModelCard(content), plots


def _run_config_text(run_dir: str | Path | None) -> str:
    p = Path(run_dir) / "config.yaml" if run_dir else None
    return p.read_text().strip() if p and p.exists() else ""


def _datasets(run_dir: str | Path | None) -> list[str]:
    """Data source paths from the run's config.yaml (hub ids become card metadata)."""
    text = _run_config_text(run_dir)
    if not text:
        return []
    import yaml

    cfg = yaml.safe_load(text) or {}
    srcs = (cfg.get("data") or {}).get("sources") or []
    return [s["path"] for s in srcs if isinstance(s, dict) and s.get("path")]


# ------------------------------------------------------------------------------------------- upload


def push_to_hub(drafter_dir: str | Path, repo_id: str, private: bool = True, run_dir: str | Path | None = None,
                target_config: Any = None, speculative_tokens: int = 5, endpoint: str | None = None,
                token: str | None = None, commit_message: str = "Upload Fledge drafter",
                attempts: int = 5, base_delay: float = 2.0) -> str:
    """Create (or update) the model repo ``repo_id`` with the export and a model card; return the commit URL.
    Refuses an export with linter errors. ``token`` defaults to ``HF_TOKEN``."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from fledge.serving.lint import format_findings, has_errors, lint_drafter

    d = Path(drafter_dir)
    findings = lint_drafter(d, target_config)
    if has_errors(findings):
        raise ValueError(f"refusing to upload {d}: it fails the linter\n" + "\n".join(format_findings(findings)))
    card, plots = build_model_card(d, repo_id, run_dir, speculative_tokens)
    api = HfApi(endpoint=endpoint, token=token or os.environ.get("HF_TOKEN") or None)
    with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True), "create_repo",
                 attempts, base_delay)

    def operations() -> list:  # fresh objects per attempt: a CommitOperationAdd is single-use
        ops = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p))
               for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith(".")]
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
        ops += [CommitOperationAdd(path_in_repo=f"eval/{p.name}", path_or_fileobj=str(p)) for p in plots]
        return ops

    info = with_retries(lambda: api.create_commit(repo_id, operations=operations(), commit_message=commit_message),
                        "create_commit", attempts, base_delay)
    log.info("uploaded %s to %s (%s)", d, repo_id, "private" if private else "public")
    return str(info.commit_url)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fledge push", description="Upload an exported drafter with a generated model card (token from HF_TOKEN, never printed).")
    ap.add_argument("drafter_dir")
    ap.add_argument("repo_id")
    ap.add_argument("--public", action="store_true", help="create a public repo (default private)")
    ap.add_argument("--run-dir", help="the run directory, for the card's eval table, plots and config")
    ap.add_argument("--target", help="target: local dir, config.json, or hub id (default: from the export)")
    ap.add_argument("--recipe", help="take the target's config from conf/recipe/<name>.yaml")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens in the card's serving commands")
    ap.add_argument("--endpoint", help="Hub endpoint (default HF_ENDPOINT or huggingface.co)")
    args = ap.parse_args(argv)
    from fledge.serving.lint import resolve_target_config

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
