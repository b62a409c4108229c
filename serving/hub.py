"""Upload an exported drafter to the Hugging Face Hub with its model card (serving/card.py).

The pipeline's publish stage and ``fledge push`` (pipeline/publish.py) call :func:`push_to_hub` with what the
run measured of the very export pushed (a ``Measured``; the card shows nothing else). The token comes from
``HF_TOKEN`` (``fledge push`` also takes huggingface_hub's own login) and is never printed or logged. An
export that fails the linter is refused, and so is an existing repo whose visibility is not the one asked for
(``create_repo(private=..., exist_ok=True)`` leaves an existing repo as it is). Transient failures (HTTP 5xx /
429, connection errors and timeouts) are retried with exponential backoff; other errors (401, 403, 404, ...)
are raised at once. Offline mode (``HF_HUB_OFFLINE``) is refused before any request, and every failure reaches
the user as one :class:`HubError` line naming the cause and the fix, without the token.
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


class HubError(ValueError):
    """The Hub cannot take the upload (offline, token refused, repo not found, unreachable): one line, the fix."""


def check_online() -> None:
    """Refuse offline mode before any request: huggingface_hub would refuse each one (and each retry). Its
    constant, read from HF_HUB_OFFLINE when it is imported, is what it enforces."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE=1 is set, and uploading needs the Hub: unset it for this command "
                       "(`env -u HF_HUB_OFFLINE fledge push ...`)")


def hub_error(exc: BaseException, what: str, repo_id: str, endpoint: str | None, token: str | None) -> HubError | None:
    """The one line a Hub failure of ``what`` reaches the user as (None: not a Hub failure, a bug keeps its
    traceback); the token never appears in it."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    where = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if isinstance(exc, OfflineModeIsEnabled):
        msg = "HF_HUB_OFFLINE=1 is set, and uploading needs the Hub: unset it for this command"
    elif isinstance(exc, LocalTokenNotFoundError):
        msg = "no Hub token: export HF_TOKEN (a write token), or log in with `hf auth login`"
    elif isinstance(exc, HfHubHTTPError):
        status = getattr(exc.response, "status_code", None)
        fix = {401: "the token was refused (401 Unauthorized): set HF_TOKEN to a valid write token",
               403: f"the token may not write to {repo_id} (403 Forbidden): use a token with write access to its "
                    "owner, or push to a repo id under your own name",
               404: f"{repo_id} or its owner was not found (404): check the repo id (org/name) and the endpoint "
                    "(--endpoint, HF_ENDPOINT)"}.get(status, f"the Hub answered HTTP {status}"
                                                     + (" (retried): try again later" if is_transient(exc) else ""))
        msg = f"{fix} [{what} at {where}]"
    elif is_transient(exc):
        msg = (f"cannot reach the Hub at {where} ({type(exc).__name__}; retried): check the network, a proxy, or "
               "--endpoint / HF_ENDPOINT")
    else:
        return None
    return HubError(f"{repo_id}: {msg.replace(token, '***') if token else msg}")


def is_transient(exc: BaseException) -> bool:
    """5xx / 429 answers and network-level failures are worth retrying; anything else (offline mode too) is not."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled):  # a ConnectionError, but no retry will be let through
        return False
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
    the commit URL. Refuses an export with linter errors. ``token`` defaults to ``HF_TOKEN``. Raises HubError
    (one line, no token) when the Hub cannot take it."""
    from huggingface_hub import CommitOperationAdd, HfApi  # the Hub client, only to upload

    check_online()
    d = Path(drafter_dir)
    findings = lint_drafter(d, target_config)
    if has_errors(findings):
        raise ValueError(f"refusing to upload {d}: it fails the linter\n" + "\n".join(format_findings(findings)))
    card, plots = build_model_card(d, repo_id, measured, speculative_tokens)
    token = token or os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)

    def call(fn: Callable[[], T], what: str) -> T:
        try:
            return with_retries(fn, what, attempts, base_delay)
        except Exception as e:  # noqa: BLE001 - a Hub failure becomes one line; anything else is a bug
            err = hub_error(e, what, repo_id, endpoint, token)
            if err is None:
                raise
            raise err from None

    call(lambda: api.create_repo(repo_id, private=private, exist_ok=True), "create_repo")
    check_visibility(repo_id, private, call(lambda: api.model_info(repo_id).private, "model_info"))

    def operations() -> list:  # fresh objects per attempt: a CommitOperationAdd is single-use
        ops = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p))
               for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith(".")]
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
        ops += [CommitOperationAdd(path_in_repo=f"eval/{p.name}", path_or_fileobj=str(p)) for p in plots]
        return ops

    info = call(lambda: api.create_commit(repo_id, operations=operations(), commit_message=commit_message),
                "create_commit")
    log.info("uploaded %s to %s (%s)", d, repo_id, "private" if private else "public")
    return str(info.commit_url)
