"""train/sequence_parallel.py without a process group: how a batch is split (shards, halo, padding, the
whole row's mask), and the bad configurations, each one line naming train.sequence_parallel. The two-rank
equality of loss and gradients is tests/distributed/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from fledge.conf import compose
from fledge.distributed import SequenceGroups, World, sequence_groups
from fledge.train.sequence_parallel import SequenceParallel, check_heads
from tests.helpers.models import packed_batch


def test_world_not_divisible_names_the_key():
    with pytest.raises(ValueError, match=r"train\.sequence_parallel=3 does not divide the world of 2 rank"):
        sequence_groups(World(0, 2, 0, torch.device("cpu")), 3)
    one = sequence_groups(World(1, 2, 1, torch.device("cpu")), 1)
    assert (one.dp_rank, one.dp_size, one.group) == (1, 2, None)


def test_heads_not_divisible_names_the_key():
    with pytest.raises(ValueError, match=r"train\.sequence_parallel=4 must divide the drafter's "
                                         r"num_key_value_heads=2"):
        check_heads(4, 2, 4)
    check_heads(2, 2, 4)


def test_size_below_one_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"train\.sequence_parallel=0"):
        compose(["recipe=tiny", "train.sequence_parallel=0"])


def test_world_is_checked_before_any_stage(tmp_path):
    from tests.helpers.cli import assert_one_line, fledge_run

    assert_one_line(fledge_run(tmp_path, "train.sequence_parallel=2"), "train.sequence_parallel=2 does not divide")


def test_split_gives_each_rank_its_rows_plus_a_halo_and_the_whole_row_mask():
    batch = packed_batch(T=19)  # two rows: documents 0 | 1 | padding, and one document
    steps = 2
    shards = [SequenceParallel(SequenceGroups(2, r, None, 0, 1), steps).split(batch) for r in (0, 1)]
    rows, halo = 10, steps + 1
    for r, s in enumerate(shards):
        assert s.rows == rows and s.batch.input_ids.shape == (2, rows + halo)
        assert s.document_ids.shape == (2, 2 * rows)
        assert s.document_ids[:, :19].equal(batch.document_ids) and (s.document_ids[:, 19:] == -1).all()
        n = min(19, r * rows + rows + halo) - r * rows
        for name in ("input_ids", "aux_hidden", "target_hidden", "target_argmax", "position_ids", "document_ids"):
            assert getattr(s.batch, name)[:, :n].equal(getattr(batch, name)[:, r * rows:r * rows + n]), name
        assert not s.batch.loss_mask[:, n:].any() and (s.batch.document_ids[:, n:] == -1).all()
    assert sum(s.num_tokens for s in shards) == batch.num_tokens
