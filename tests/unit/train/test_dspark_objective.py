"""The DSpark objective (train/objectives/dspark.py: DFlash's over a DSpark drafter): every slot of a block of B scored,
slot j on the token at a + 1 + j against the target's row at a + j with weight exp(-j / gamma) from 1, its logits
biased by the data's token before it; equal to a per-anchor reference built from the engine's sequential draft with
its picks forced to the data; the Markov head trained."""

import math

import pytest
import torch
import torch.nn.functional as F

from fledge.train.losses import SoftCrossEntropy
from fledge.train.objectives import OBJECTIVES
from fledge.train.objectives.dflash import DFlashObjective, build
from tests.helpers.models import block_batch as batch, random_dspark

B = 3  # random_dspark's block: 3 tokens drafting 3


def objective(decay=4.0):
    return DFlashObjective(SoftCrossEntropy(steps=1, step_weight=1.0, chunk_size=5), block_size=B, num_anchors=64,
                           position_decay=decay, chunk_size=5)


def test_dspark_trains_with_dflashs_builder():
    assert OBJECTIVES.get("dspark") is build is OBJECTIVES.get("dflash")


def test_loss_equals_a_per_anchor_reference():
    d = random_dspark(num_draft_layers=1)
    b = batch()
    obj = objective()
    head = d.lm_head.weight.detach()
    res = obj(d, b, head)
    doc, m, x = b.document_ids[0], b.loss_mask[0], b.input_ids[0]
    sums, counts, right = [0.0] * B, [0] * B, [0] * B
    with torch.no_grad():
        for a in obj.anchors(b)[0].tolist():
            start = int((doc[:a] != doc[a]).nonzero().max()) + 1 if (doc[:a] != doc[a]).any() else 0
            kv = d.context_kv(d.context(b.aux_hidden[:, start:a]), b.position_ids[:, start:a])
            forced = iter(x[a + 1:a + 1 + B].tolist() + [0] * B)  # the data's tokens (padded past the row's end)
            _, logits = d.propose(x[a:a + 1], b.position_ids[0, a:a + 1], kv, B,
                                  lambda _, forced=forced: torch.tensor([next(forced)]))
            for j in range(B):
                p = a + 1 + j
                if p < len(doc) and doc[p] == doc[a] and m[p]:  # x_p in the loss mask, same document
                    teacher = b.target_hidden[0, p - 1] @ head.T  # the target's state that predicted x_p
                    sums[j] += float(-(F.softmax(teacher, -1) * F.log_softmax(logits[0, j], -1)).sum())
                    counts[j] += 1
                    right[j] += int(logits[0, j].argmax() == b.target_argmax[0, p - 1])
    assert obj.counted_rows(d, b).tolist() == counts and all(counts)
    want = sum(math.exp(-j / 4.0) * s / c for j, (s, c) in enumerate(zip(sums, counts)))
    assert float(res.loss.detach()) == pytest.approx(want, rel=1e-4)
    for j in range(B):
        assert float(res.metrics[f"loss_{j}"][0]) == pytest.approx(sums[j], rel=1e-4)
        assert [float(v) for v in res.metrics[f"acc_{j}"]] == [right[j], counts[j]]


def test_gradients_reach_every_trained_weight_the_markov_head_too():
    d = random_dspark(num_draft_layers=2)
    d.train()
    objective()(d, batch(), d.lm_head.weight.detach()).loss.backward()
    for name, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert d.markov_head.markov_w1.weight.grad is not None and d.markov_head.markov_w2.weight.grad is not None
    assert d.lm_head.weight.grad is None and d.embed_tokens.weight.grad is None  # the target's, frozen
