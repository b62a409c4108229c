"""The TTT alignment of models/alignment.py is the one the loss, the held-out accuracy and the AL estimate use:
they count the same rows, and a planted off-by-one in it moves all three together."""

from dataclasses import fields

import pytest
import torch

from fledge.data.features.batch import FeatureBatch
from fledge.evaluation.heldout import heldout_accuracy
from fledge.models import alignment
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.train.losses import ttt_loss
from fledge.train.metrics import RatioMeter
from tests.helpers.models import make_drafter, packed_batch

K = 3


class _Target:
    """What heldout_accuracy reads of a FrozenTarget: ``capture(ids) -> (aux, final normed state, argmax)``."""

    device = torch.device("cpu")

    def __init__(self, batch):
        self.batch = batch

    def capture(self, ids, chunk_tokens=0):
        assert torch.equal(ids, self.batch.input_ids)
        return self.batch.aux_hidden, self.batch.target_hidden, self.batch.target_argmax


def one_document():
    """Row 1 of the packed test batch (one document, no padding), with a draft vocab that leaves out some
    teacher argmaxes and a drafter made to be right at some rows, so every count is non-trivial."""
    d = make_drafter()
    sel = torch.arange(50)[torch.arange(50) % 5 != 0]  # 40 ids; multiples of 5 are outside
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[sel] = True
    d.set_vocab(sel - torch.arange(40), t2d)
    packed = packed_batch()
    b = FeatureBatch(**{f.name: getattr(packed, f.name)[1:] for f in fields(packed)})
    with torch.no_grad():
        pred = d.draft_to_target(d.lm_head(alignment.ttt_states(d, b, 1)[0]).argmax(-1))
    # step 0 scores row t against the argmax at t+1: make it the drafter's own guess at every other row
    even = torch.arange(b.input_ids.shape[1] - 1) % 2 == 0
    b.target_argmax[0, 1:] = torch.where(even, pred[0, :-1], b.target_argmax[0, 1:])
    return d, b


def measure(d, b):
    """(loss result, its StepAccuracy, held-out accuracy) on the same document."""
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        res = ttt_loss(d, b, head, steps=K, step_weight=0.8, chunk_size=5)
    meter = RatioMeter()
    meter.add(res.metrics)
    held = heldout_accuracy(d, _Target(b), [(b.input_ids[0].tolist(), b.loss_mask[0].tolist())], K)
    return res, StepAccuracy.from_values(meter.reduce(), K), held


def test_loss_and_heldout_accuracy_count_the_same_rows():
    d, b = one_document()
    res, acc, held = measure(d, b)
    for k in range(K):
        assert held["rows"][k] == float(res.metrics[f"acc_{k}"][1]) > 0
        assert held["acc"][k] == pytest.approx(acc.acc[k])
    assert 0 < acc.acc[0] < 1  # some rows right, some wrong: the comparison is not vacuous
    assert al_estimate(acc) == pytest.approx(1 + sum(acc.full_acc))


def test_a_planted_off_by_one_moves_loss_heldout_and_al_estimate(monkeypatch):
    d, b = one_document()
    before = measure(d, b)
    monkeypatch.setattr(alignment, "lead", lambda k: 2 + k)  # step k reads two tokens ahead instead of one
    after = measure(d, b)
    (res0, acc0, held0), (res1, acc1, held1) = before, after
    assert not torch.isclose(res0.loss, res1.loss)
    assert held0["rows"] != held1["rows"] and held0["acc"] != held1["acc"]
    assert al_estimate(acc0) != pytest.approx(al_estimate(acc1))
    # and the three still agree with each other: they follow the one (now wrong) alignment together
    for k in range(K):
        assert held1["rows"][k] == float(res1.metrics[f"acc_{k}"][1])
        assert held1["acc"][k] == pytest.approx(acc1.acc[k])


def test_out_of_vocab_teacher_rows_are_misses_for_accuracy_and_the_estimate():
    """A drafter right at every row of one document, except that at known rows the teacher's argmax is a
    target id outside the draft vocab: those rows stay out of the loss but count as misses in acc_0, the AL
    estimate and the held-out accuracy (the drafter can never propose that token, so an engine rejects it)."""
    d, b = one_document()
    with torch.no_grad():
        pred = d.draft_to_target(d.lm_head(alignment.ttt_states(d, b, 1)[0]).argmax(-1))
    T = b.input_ids.shape[1]
    b.target_argmax[0, 1:] = pred[0, :-1]  # step 0 scores row t against the argmax at t+1: right everywhere
    scored = [t for t in range(T - 2) if bool(b.loss_mask[0, t + 2])]  # one document, no padding
    planted = scored[1::3]
    for i, t in enumerate(planted):
        b.target_argmax[0, t + 1] = 5 * (i % 9)  # multiples of 5 are outside the draft vocab
    assert not d.t2d[b.target_argmax[0, [t + 1 for t in planted]]].any() and len(planted) >= 3
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        res = ttt_loss(d, b, head, steps=1, step_weight=0.8, chunk_size=5)
    meter = RatioMeter()
    meter.add(res.metrics)
    acc = StepAccuracy.from_values(meter.reduce(), 1)
    want = 1 - len(planted) / len(scored)
    assert float(res.metrics["loss_0"][1]) == len(scored) - len(planted)  # the loss keeps its rule
    assert tuple(float(x) for x in res.metrics["acc_0"]) == (len(scored) - len(planted), len(scored))
    assert acc.acc[0] == pytest.approx(want) and acc.full_acc[0] == pytest.approx(want)
    assert al_estimate(acc) == pytest.approx(1 + want)
    held = heldout_accuracy(d, _Target(b), [(b.input_ids[0].tolist(), b.loss_mask[0].tolist())], 1)
    assert held["rows"] == [len(scored)] and held["acc"][0] == pytest.approx(want)
    assert held["full_acc"][0] == pytest.approx(want)


def test_step_rows_from_spec_section_4():
    """Row t of step k: teacher row t+1+k; scored iff x_{t+2+k} is masked and in t's document; counted (in
    the loss) iff scored and the teacher argmax is in the draft vocab."""
    doc = torch.tensor([[0] * 6 + [1] * 3 + [-1]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    argmax = torch.arange(10)[None]
    t2d = torch.arange(10) != 2  # target id 2 is outside the draft vocab
    s0 = alignment.step_rows(mask, doc, argmax, t2d, 0)
    assert s0.lead == 1 and s0.teacher_argmax.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]]
    # t=1: teacher 2 outside; t=2: x4 unmasked; t=4, 5: x6, x7 in the next document; t=7: x9 is padding
    assert s0.counted[0].nonzero().squeeze(1).tolist() == [0, 3, 6]
    assert s0.scored[0].nonzero().squeeze(1).tolist() == [0, 1, 3, 6]  # t=1 is a miss, not left out
    s1 = alignment.step_rows(mask, doc, argmax, t2d, 1)
    assert s1.lead == 2 and s1.teacher_argmax.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 0, 0]]
    # t=0: teacher 2 outside; t=1: x4 unmasked; t=3..5: x6..x8 in the next document; t=6: x9 padding
    assert s1.counted[0].nonzero().squeeze(1).tolist() == [2]
    assert s1.scored[0].nonzero().squeeze(1).tolist() == [0, 2]
    tokens, positions = alignment.step_inputs(argmax, torch.arange(10)[None], 2)
    assert tokens.tolist() == [[3, 4, 5, 6, 7, 8, 9, 0, 0, 0]] and positions[0, :3].tolist() == [2, 3, 4]


def test_a_block_drafter_is_held_out_scored_on_its_trained_block():
    """A block drafter's held-out accuracy unrolls no further than its block: asked for 2K steps (the eval stage's
    default) it scores the K slots of the trained block, as the engine serves it, and a longer block (whose extra
    masks every slot would attend to) is never built."""
    from tests.helpers.models import block_batch, random_dflash

    d = random_dflash(block_size=4, num_draft_layers=1, draft_vocab_size=150)
    b = block_batch()
    b = FeatureBatch(**{**{f.name: getattr(b, f.name) for f in fields(b)},
                        "document_ids": torch.zeros_like(b.document_ids)})  # one conversation, as held out
    sample = [(b.input_ids[0].tolist(), b.loss_mask[0].tolist())]
    held = heldout_accuracy(d, _Target(b), sample, 2 * d.drafts)
    assert held["steps"] == d.drafts == 3 and len(held["acc"]) == len(held["full_acc"]) == 3
    assert held == heldout_accuracy(d, _Target(b), sample, d.drafts)
    assert heldout_accuracy(d, _Target(b), sample, 1)["steps"] == 1
