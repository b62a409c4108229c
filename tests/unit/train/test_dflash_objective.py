"""The DFlash objective (train/objectives/dflash.py): each block offset scored against the right teacher row, equal to a
per-anchor reference built from the engine-style draft; the row counts the trainer divides by; the anchors; the mask
token the trainer picks."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fledge.train.losses import SoftCrossEntropy
from fledge.train.objectives.dflash import DFlashObjective, mask_token
from tests.helpers.models import DFLASH_TARGET as TARGET, block_batch as batch, random_dflash

B = 4  # block size


def objective(anchors=64, decay=7.0):
    return DFlashObjective(SoftCrossEntropy(steps=1, step_weight=1.0, chunk_size=5), block_size=B,
                           num_anchors=anchors, position_decay=decay, chunk_size=5)


def test_anchors_are_deterministic_valid_and_bounded():
    b = batch()
    a = objective().anchors(b)[0]
    assert a.tolist() == objective().anchors(b)[0].tolist() == sorted(set(a.tolist()))
    doc, m = b.document_ids[0], b.loss_mask[0]
    assert all(doc[t] >= 0 and doc[t + 1] == doc[t] and m[t + 1] for t in a.tolist())
    assert len(a) == int(((doc[:-1] >= 0) & (doc[1:] == doc[:-1]) & m[1:]).sum())  # all of them: 64 > candidates
    assert len(objective(anchors=3).anchors(b)[0]) == 3


def reference(d, b, obj, head):
    """Per drafted slot: the summed soft CE, the scored labels and the right drafts, one anchor at a time from the
    engine-style draft over the anchor's own document: a label x_p scored where it is in the loss mask, the anchor's
    document and (over a draft vocab) the target's argmax at p - 1 is a draft-vocab id."""
    doc, m = b.document_ids[0], b.loss_mask[0]
    sums, counts, right = [0.0] * (B - 1), [0] * (B - 1), [0] * (B - 1)
    with torch.no_grad():
        for a in obj.anchors(b)[0].tolist():
            start = int((doc[:a] != doc[a]).nonzero().max()) + 1 if (doc[:a] != doc[a]).any() else 0
            kv = d.context_kv(d.context(b.aux_hidden[:, start:a]), b.position_ids[:, start:a])
            logits = d.draft(b.input_ids[0, a:a + 1], b.position_ids[0, a:a + 1], kv, B - 1)[0]
            for k in range(1, B):
                p = a + k
                if p < len(doc) and doc[p] == doc[a] and m[p] and d.t2d[b.target_argmax[0, p - 1]]:
                    teacher = b.target_hidden[0, p - 1] @ head.T  # the target's state that predicted x_p
                    sums[k - 1] += float(-(F.softmax(teacher, -1) * F.log_softmax(logits[k - 1], -1)).sum())
                    counts[k - 1] += 1
                    right[k - 1] += int(d.draft_to_target(logits[k - 1].argmax()) == b.target_argmax[0, p - 1])
    return sums, counts, right


def test_loss_equals_a_per_anchor_reference():
    d = random_dflash(block_size=B, num_draft_layers=1)
    b = batch()
    obj = objective()
    head = d.lm_head.weight.detach()
    res = obj(d, b, head)
    sums, counts, right = reference(d, b, obj, head)
    assert obj.counted_rows(d, b).tolist() == counts and all(counts)
    want = sum(math.exp(-k / 7.0) * s / c for k, (s, c) in enumerate(zip(sums, counts)))
    assert float(res.loss.detach()) == pytest.approx(want, rel=1e-4)
    for k in range(B - 1):
        assert float(res.metrics[f"loss_{k}"][0]) == pytest.approx(sums[k], rel=1e-4)
        assert [float(x) for x in res.metrics[f"acc_{k}"]] == [right[k], counts[k]]


def test_a_draft_vocab_scores_only_the_labels_it_can_draft():
    """Over a draft vocab a label counts only where the target's argmax is one of its ids (as an EAGLE step's rows),
    the teacher is the target's distribution restricted to those ids, and a right draft is its target id."""
    d = random_dflash(block_size=B, num_draft_layers=1, draft_vocab_size=150)
    b = batch()
    b.target_argmax[0] = torch.where(torch.arange(b.target_argmax.shape[1]) % 2 == 0,
                                     (d.d2t + torch.arange(150))[b.target_argmax[0] % 150],  # ids of the vocab
                                     (~d.t2d).nonzero().flatten()[b.target_argmax[0] % 150])  # ids outside it
    obj, whole = objective(), random_dflash(block_size=B, num_draft_layers=1)
    counts, all_counts = obj.counted_rows(d, b), obj.counted_rows(whole, b)
    assert 0 < int(counts.sum()) < int(all_counts.sum())
    head = d.lm_head.weight.detach()  # the target's rows of the vocab: the teacher's head
    res = obj(d, b, head)
    sums, want_counts, right = reference(d, b, obj, head)
    assert counts.tolist() == want_counts
    for k in range(B - 1):
        assert float(res.metrics[f"loss_{k}"][0]) == pytest.approx(sums[k], rel=1e-4)
        assert [float(x) for x in res.metrics[f"acc_{k}"]] == [right[k], want_counts[k]]
    with pytest.raises(ValueError, match="drafts over 150 ids"):
        obj(d, b, whole.lm_head.weight.detach())


def test_gradients_reach_every_trained_weight():
    d = random_dflash(block_size=B, num_draft_layers=2)
    d.train()
    objective()(d, batch(), d.lm_head.weight.detach()).loss.backward()
    for name, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert d.lm_head.weight.grad is None and d.embed_tokens.weight.grad is None  # the target's, frozen


def test_mask_token_with_a_zero_embedding():
    emb = torch.randn(300, 64)
    emb[0] = 0  # a padding row
    spec = SimpleNamespace(mask_token_id=0)
    assert mask_token(spec, TARGET, emb, None) == 5  # the eos token instead
    with pytest.raises(ValueError, match="drafter.mask_token_id=0: the target's embedding of that token is zero"):
        mask_token(spec, TARGET, emb, 0)
    assert mask_token(SimpleNamespace(mask_token_id=9), TARGET, emb, 9) == 9
