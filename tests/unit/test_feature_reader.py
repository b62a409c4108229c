"""The trainer's data order and the store's path handling, on synthetic samples and hand-written stores.

The global batch plan must be the same sequence for every world size that divides the global batch, in
every epoch (that is what makes 2 ranks x 1 micro-batch = 1 rank x 2 and a resume on another world size
exact); a manifest or index must not make the reader open files outside the store.
"""

from __future__ import annotations

import torch

from fledge.data.feature_reader import BatchIterator

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
    resumed[0].seek(30 * 2 * 2)  # what trainer.py does: step * grad_accum * world
    assert first + _run(resumed, steps=30, accum=4) == full
