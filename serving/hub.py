"""Upload an exported drafter to the Hugging Face Hub with its model card (serving/card.py).

The pipeline's publish stage and ``fledge push`` (pipeline/publish.py) call :func:`push_to_hub` with what the
run measured of the very export pushed (a ``Measured``; the card shows nothing else). The token comes from
``HF_TOKEN`` (``fledge push`` also takes huggingface_hub's own login) and is never printed or logged. An
export that fails the linter is refused, and so is an existing repo whose visibility is not the one asked for
(``create_repo(private=..., exist_ok=True)`` leaves an existing repo as it is). Transient failures (HTTP 5xx /
429, connection errors and timeouts) are retried with exponential backoff; other errors (401, 403, 404, ...)
are raised at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fledge.serving.card import Measured, build_model_card
from fledge.serving.lint import format_findings, has_errors, lint_drafter

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def check_visibility(repo_id: str, private: bool, is_private: bool | None) -> None:
    """Refuse to push into ``repo_id`` when it exists with another visibility than ``private`` asks for."""
    if is_private is None or bool(is_private) == private:
        return
    if private:
        raise ValueError(f"{repo_id} already exists on the Hub and is public, but the push asks for a private repo "
                         "(export.private=true, the default; `fledge push` without --public): make it private in "
                         "its settings, push to another export.repo_id, or set export.private=false to publish")
    raise ValueError(f"{repo_id} already exists on the Hub and is private, but the push asks for a public repo "
                     "(export.private=false; `fledge push --public`): make it public in its settings, or push "
                     "with export.private=true")


def push_to_hub(drafter_dir: str | Path, repo_id: str, private: bool = True, measured: Measured | None = None,
                target_config: Any = None, speculative_tokens: int = 5, endpoint: str | None = None,
                token: str | None = None, commit_message: str = "Upload Fledge drafter",
                attempts: int = 5, base_delay: float = 2.0) -> str:
    """Create (or update) the model repo ``repo_id`` with the export and a model card of ``measured``; return
    the commit URL. Refuses an export with linter errors. ``token`` defaults to ``HF_TOKEN``."""
    from huggingface_hub import CommitOperationAdd, HfApi  # the Hub client, only to upload

    d = Path(drafter_dir)
    findings = lint_drafter(d, target_config)
    if has_errors(findings):
        raise ValueError(f"refusing to upload {d}: it fails the linter\n" + "\n".join(format_findings(findings)))
    card, plots = build_model_card(d, repo_id, measured, speculative_tokens)
    api = HfApi(endpoint=endpoint, token=token or os.environ.get("HF_TOKEN") or None)
    with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True), "create_repo",
                 attempts, base_delay)
    check_visibility(repo_id, private, with_retries(lambda: api.model_info(repo_id).private, "model_info",
                                                    attempts, base_delay))

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
