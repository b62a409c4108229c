"""Packing short samples into fixed-length rows, keeping document ids so attention never crosses them.

:func:`plan_rows` decides which samples share a row (deterministic best-fit-decreasing, then a seeded
shuffle of the rows); :func:`collate` turns one slice of that plan into a :class:`data.batch.FeatureBatch`.
A sample longer than ``row_tokens`` gets a row of its own and is truncated at collation; callers count
the loss with :func:`collate_stats`.
"""

from __future__ import annotations

import bisect
import random

import torch

from fledge.data.features.batch import FeatureBatch

_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "target_hidden", "target_argmax")


def plan_rows(lengths: list[int], row_tokens: int, seed: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``row_tokens`` tokens.

    Best-fit-decreasing over (length desc, index asc): each sample goes to the open row with the least
    room that still fits it (ties: the oldest row), so the plan depends only on the lengths; the rows
    are then shuffled with ``seed`` (the order samples reach the trainer). Samples within a row stay in
    ascending index order. A sample longer than ``row_tokens`` is alone in its row.
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens={row_tokens}: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    # Free space per open row, kept sorted as (free, row) so best fit is a bisect; ties -> oldest row.
    free: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        if n <= 0:
            continue
        if n >= row_tokens:
            rows.append([i])
            continue
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, r = free.pop(k)
            rows[r].append(i)
            if space - n > 0:
                bisect.insort(free, (space - n, r))
        else:
            rows.append([i])
            bisect.insort(free, (row_tokens - n, len(rows) - 1))
    for r in rows:
        r.sort()
    random.Random(seed).shuffle(rows)
    return rows


def collate(rows: list[list[dict]], row_tokens: int) -> FeatureBatch:
    """Build a batch from ``rows`` (a list of rows, each a list of sample dicts; one batch row per row).

    Each sample holds ``input_ids`` [T] int64, ``loss_mask`` [T] bool, ``aux_hidden`` [T, n*Ht],
    ``target_hidden`` [T, Ht], ``target_argmax`` [T] int64. Samples are concatenated in order and the
    row padded to ``row_tokens`` (ids 0, mask false, zeros, document id -1); ``position_ids`` restart at 0
    per sample. Tokens past ``row_tokens`` are dropped (see :func:`collate_stats`). A flat list of sample
    dicts is accepted as one row.
    """
    if rows and isinstance(rows[0], dict):
        rows = [rows]  # type: ignore[list-item]
    if not rows or not any(rows):
        raise ValueError("collate: no samples")
    first = next(s for r in rows for s in r)
    aux_dim, hid_dim = first["aux_hidden"].shape[-1], first["target_hidden"].shape[-1]
    dtype = first["aux_hidden"].dtype
    B, T = len(rows), row_tokens
    out = FeatureBatch(
        input_ids=torch.zeros(B, T, dtype=torch.int64),
        loss_mask=torch.zeros(B, T, dtype=torch.bool),
        aux_hidden=torch.zeros(B, T, aux_dim, dtype=dtype),
        target_hidden=torch.zeros(B, T, hid_dim, dtype=first["target_hidden"].dtype),
        target_argmax=torch.zeros(B, T, dtype=torch.int64),
        position_ids=torch.zeros(B, T, dtype=torch.int64),
        document_ids=torch.full((B, T), -1, dtype=torch.int32),
    )
    for b, row in enumerate(rows):
        pos = 0
        for d, s in enumerate(row):
            n = min(len(s["input_ids"]), T - pos)
            if n <= 0:
                break
            sl = slice(pos, pos + n)
            for f in _FIELDS:
                getattr(out, f)[b, sl] = torch.as_tensor(s[f][:n]).to(getattr(out, f).dtype)
            out.position_ids[b, sl] = torch.arange(n)
            out.document_ids[b, sl] = d
            pos += n
    return out


def collate_stats(rows: list[list[dict]], row_tokens: int) -> dict[str, int]:
    """Tokens kept and dropped (truncated) when ``rows`` are collated at ``row_tokens``."""
    total = sum(len(s["input_ids"]) for r in rows for s in r)
    kept = sum(min(row_tokens, sum(len(s["input_ids"]) for s in r)) for r in rows)
    return {"tokens": kept, "truncated_tokens": total - kept}
