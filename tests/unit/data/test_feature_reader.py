"""The trainer's data order and the store's path handling, on synthetic samples and hand-written stores.

The global batch plan must be the same sequence for every world size that divides the global batch, in
every epoch (that is what makes 2 ranks x 1 micro-batch = 1 rank x 2 and a resume on another world size
exact); a manifest or index must not make the reader open files outside the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fledge.atomic import sha256_file
from fledge.data.features.reader import BatchIterator, FeatureStore
from fledge.data.features.store import INDEX, SCHEMA_VERSION, STORE_MANIFEST

ROW = 8


class _Synthetic(BatchIterator):
    """Sample i is ``ROW`` tokens of id i: alone in its row, so a batch's input_ids name its samples."""

    def fetch(self, indices: list[int]) -> list[dict]:
        return [{"input_ids": torch.full((ROW,), i), "loss_mask": torch.ones(ROW, dtype=torch.bool),
                 "aux_hidden": torch.zeros(ROW, 3), "target_hidden": torch.zeros(ROW, 1),
                 "target_argmax": torch.zeros(ROW, dtype=torch.long)} for i in indices]


def _run(ranks: list[_Synthetic], steps: int, accum: int) -> list[tuple[int, list[int]]]:
    """(global index, sample ids) of every micro-batch ``steps`` trainer steps run, in global order."""
    seq = []
    for _ in range(steps):
        for _ in range(accum):
            for ld in ranks:  # one round: rank r takes global batch position + r
                g, batch = ld.next_batch()
                seq.append((g, batch.input_ids[:, 0].tolist()))
    return seq


def _loaders(world: int, n_samples: int = 101) -> list[_Synthetic]:
    return [_Synthetic([ROW] * n_samples, r, world, ROW, 1, seed=11) for r in range(world)]


def _global_sequence(world: int, steps: int, accum: int) -> list[tuple[int, list[int]]]:
    return _run(_loaders(world), steps, accum)


def test_two_epochs_of_101_batches_are_the_same_sequence_on_1_and_2_ranks():
    """101 batches per epoch (odd: the old plan dropped one per epoch on 2 ranks, shifting epoch 1)."""
    one = _Synthetic([ROW] * 101, 0, 1, ROW, 1, seed=11)
    two = _Synthetic([ROW] * 101, 0, 2, ROW, 1, seed=11)
    assert one.global_batches_per_epoch == two.global_batches_per_epoch == 101  # the trainer's step count
    single = _global_sequence(world=1, steps=101, accum=2)  # 202 micro-batches: two epochs
    double = _global_sequence(world=2, steps=101, accum=1)
    assert [g for g, _ in single] == list(range(202))
    assert double == single
    ids = [s for _, b in single for s in b]
    assert sorted(ids[:101]) == sorted(ids[101:]) == list(range(101))  # each epoch sees every sample once
    assert ids[:101] != ids[101:]  # ... in a new order


def test_a_resume_on_another_world_size_continues_the_sequence():
    """Global batch 4: 2 ranks x 2 micro-batches run 30 steps (past epoch 0's end), then 1 rank x 4 resumes
    for 30 more (past epoch 1's): together they run what 1 rank x 4 runs uninterrupted."""
    full = _global_sequence(world=1, steps=60, accum=4)
    first = _run(_loaders(2), steps=30, accum=2)
    resumed = _loaders(1)
    resumed[0].seek(30 * 2 * 2)  # the global batches consumed, as the checkpoint stores them
    assert first + _run(resumed, steps=30, accum=4) == full


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_held_out_eval_reads_the_same_global_batches_on_any_world_size(world):
    """train.eval_batches=5 is global batches 0..4 of epoch 0, split over the ranks, on any world size
    (the best checkpoint is chosen on the same set after a resume elsewhere); every rank runs the same
    number of forwards (ZeRO-3 gathers weights in each), a rank one short running a filler it does not
    count. More batches than the epoch holds: the epoch once, nothing counted twice."""
    plan = _loaders(1, n_samples=13)[0].global_plan(0)
    for n, want in ((5, 5), (40, 13)):
        shares = [list(ld.eval_batches(n)) for ld in _loaders(world, n_samples=13)]
        assert len({len(s) for s in shares}) == 1, [len(s) for s in shares]  # same forwards on every rank
        counted = sorted(b.input_ids[0, 0].item() for share in shares for b, counts in share if counts)
        assert counted == sorted(plan[g][0][0] for g in range(want))


# ---- containment: a store names only files inside itself ------------------------------------------------

ESCAPES = ["../outside", "/etc/passwd", "rank00000/../../outside", "..", "C:/x", "a\\..\\..\\x", ""]


def _store(root: Path, indexes=("rank00000",), shard="shard-00000.safetensors", manifest_path=None) -> Path:
    """A complete one-shard store written by hand (a real capture cannot write an escaping entry)."""
    from safetensors.torch import save_file

    store = root / "store"
    (store / "rank00000").mkdir(parents=True)
    T = 4
    save_file({"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
               "aux_hidden": torch.zeros(T, 3, dtype=torch.bfloat16),
               "target_hidden": torch.zeros(T, 1, dtype=torch.bfloat16),
               "target_argmax": torch.zeros(T, dtype=torch.int32)},
              str(store / "rank00000" / "shard-00000.safetensors"))
    sha = sha256_file(store / "rank00000" / "shard-00000.safetensors")
    (store / "rank00000" / INDEX).write_text(json.dumps(
        {"complete": True,
         "shards": [{"name": shard, "sha256": sha, "bytes": 0, "tokens": T, "samples": [[0, 0, T]]}]}))
    (store / STORE_MANIFEST).write_text(json.dumps(
        {"complete": True, "schema_version": SCHEMA_VERSION, "aux_layer_ids": [1, 2, 3], "indexes": list(indexes),
         "shards": [{"path": manifest_path or f"rank00000/{shard}", "sha256": sha}]}))
    return store


def test_a_well_formed_hand_written_store_reads(tmp_path):
    store = FeatureStore(_store(tmp_path))
    assert len(store) == 1 and store[0]["input_ids"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("entry", ESCAPES)
def test_an_index_entry_outside_the_store_is_refused(tmp_path, entry):
    with pytest.raises(ValueError, match=r"store\.json: indexes entry .* points outside"):
        FeatureStore(_store(tmp_path, indexes=("rank00000", entry)))


@pytest.mark.parametrize("entry", ESCAPES)
def test_a_shard_name_outside_its_rank_directory_is_refused(tmp_path, entry):
    with pytest.raises(ValueError, match=r"rank00000/index\.json: shards\[\]\.name entry .* points outside"):
        FeatureStore(_store(tmp_path, shard=entry, manifest_path="rank00000/shard-00000.safetensors"))


def test_a_manifest_shard_path_outside_the_store_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"store\.json: shards\[\]\.path entry '\.\./x' points outside"):
        FeatureStore(_store(tmp_path, manifest_path="../x"))
