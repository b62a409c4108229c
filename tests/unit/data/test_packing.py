"""Packing plan and collation into FeatureBatch rows with per-document positions."""

import random

import torch

from fledge.data.features.packing import collate, collate_stats, plan_rows


def test_plan_rows_fits_and_is_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(200)] + [150, 0]
    rows = plan_rows(lengths, 64, seed=3)
    assert rows == plan_rows(lengths, 64, seed=3) and rows != plan_rows(lengths, 64, seed=4)
    flat = sorted(i for r in rows for i in r)
    assert flat == [i for i, n in enumerate(lengths) if n > 0]  # every non-empty sample exactly once
    for r in rows:
        assert r == sorted(r)
        assert sum(lengths[i] for i in r) <= 64 or r == [200]
    lower = -(-sum(min(n, 64) for n in lengths) // 64)
    next_fit, room = 0, 0
    for n in lengths:
        if n > room:
            next_fit, room = next_fit + 1, 64
        room -= n
    assert lower <= len(rows) < 0.8 * next_fit  # decreasing best fit packs far tighter than next fit


def _sample(n, base, aux=6, hid=2):
    return {"input_ids": torch.arange(base, base + n), "loss_mask": torch.arange(n) % 2 == 0,
            "aux_hidden": torch.full((n, aux), float(base)), "target_hidden": torch.full((n, hid), float(base)),
            "target_argmax": torch.arange(n) + 100}


def test_collate_rows_positions_documents():
    rows = [[_sample(3, 10), _sample(2, 20)], [_sample(7, 30)]]
    b = collate(rows, 6)
    assert b.input_ids.shape == (2, 6) and b.aux_hidden.shape == (2, 6, 6) and b.target_hidden.shape == (2, 6, 2)
    assert b.input_ids[0].tolist() == [10, 11, 12, 20, 21, 0]
    assert b.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0]
    assert b.document_ids[0].tolist() == [0, 0, 0, 1, 1, -1]
    assert b.loss_mask[0].tolist() == [True, False, True, True, False, False]
    assert b.aux_hidden[0, :, 0].tolist() == [10, 10, 10, 20, 20, 0]
    assert b.input_ids[1].tolist() == [30, 31, 32, 33, 34, 35]  # truncated at row_tokens
    assert b.document_ids.dtype == torch.int32 and b.num_tokens == 11
    assert collate_stats(rows, 6) == {"tokens": 11, "truncated_tokens": 1}
