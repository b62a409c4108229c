"""What every export's lint reads first, written once: a finding's shape, and an export directory's tensor headers
and training record, each with the finding that says why it could not be read (serving/dflash_layout.py,
dspark_layout.py, mtp_layout.py; serving/lint.py reports the findings)."""

from __future__ import annotations

from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.models.weights import tensor_headers

Finding = tuple[str, str, str, str]  # (level, code, message, fix), as serving/lint.py reports them


def read_export(d, record: dict | None) -> tuple[dict | None, DrafterSpec | None, list[Finding]]:
    """An export's {tensor: (shape, dtype)} and training spec (None where unreadable), and the findings of what could
    not be read."""
    out: list[Finding] = []
    try:
        headers = {name: (list(shape), dtype) for name, (shape, dtype) in tensor_headers(d).items()}
    except (OSError, ValueError, KeyError) as e:
        out.append(("error", "no-weights", f"cannot read the safetensors in {d}: {e}", "re-export the drafter"))
        headers = None
    try:
        trained = DrafterCheckpoint.record_spec(record)
    except (TypeError, ValueError) as e:
        out.append(("error", "training-record", f"{RECORD} does not hold a readable spec: {e}",
                    "re-export the drafter"))
        trained = None
    return headers, trained, out
