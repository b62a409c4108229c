"""What every export's lint reads first, written once: a finding's shape, an export directory's tensor headers and
training record, each with the finding that says why it could not be read, and its draft vocab map's findings
(serving/dflash_layout.py, dspark_layout.py, mtp_layout.py; serving/lint.py reports the findings)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.models.weights import read_tensors, tensor_headers

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


def vocab_map_findings(d, V: int, Vd: int, headers: Mapping) -> list[Finding]:
    """d2t are offsets: target_id = i + d2t[i], strictly ascending, inside [0, V); t2d marks the same ids (its shape
    and both dtypes are the tensor checks')."""
    tensors = read_tensors(d, [n for n in ("d2t", "t2d") if n in headers])
    d2t = tensors["d2t"].to(torch.int64)
    if d2t.numel() != Vd:
        return []  # reported as a shape error
    ids = torch.arange(Vd) + d2t
    if bool((ids < 0).any() or (ids >= V).any()):
        return [("error", "d2t-range", f"d2t maps draft ids to target ids outside [0, {V})",
                 "rebuild the draft vocab (d2t = sel - arange(Vd), sel sorted target ids)")]
    out: list[Finding] = []
    if Vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
        out.append(("error", "d2t-order", "i + d2t[i] is not strictly ascending: d2t holds absolute ids or a "
                    "non-sorted selection (lm_head rows must be in ascending target-id order)",
                    "rebuild the draft vocab: sel = sorted target ids, d2t = sel - arange(Vd)"))
    if "t2d" in tensors and tensors["t2d"].numel() == V:
        t2d = tensors["t2d"].to(torch.bool)
        marked = torch.zeros(V, dtype=torch.bool)
        marked[ids.clamp(0, V - 1)] = True
        if not torch.equal(marked, t2d):
            out.append(("error", "t2d-mismatch", f"t2d marks {int(t2d.sum())} ids that differ from d2t's {Vd} target "
                        "ids (a stale or mixed vocab map)", "rebuild t2d from d2t (t2d[i + d2t[i]] = true), or "
                        "re-export"))
    return out


def vocab_findings(d, config: Mapping, headers: Mapping | None) -> list[Finding]:
    """The vocab map's findings of an export whose config.json is ``config`` (none without a d2t to read)."""
    if not headers or "d2t" not in headers:
        return []
    V = int(config["vocab_size"])
    return vocab_map_findings(d, V, int(config.get("draft_vocab_size") or V), headers)
