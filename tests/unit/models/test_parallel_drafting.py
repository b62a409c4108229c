"""P-EAGLE (``drafter.parallel_drafting``): the unroll trains what vLLM's parallel drafting serves.

vLLM (``parallel_drafting=True``, vllm/v1/spec_decode/llm_base_proposer.py) drafts all k tokens in one forward:
the verified row (next token, target state) and k-1 slots fed the config's ``mask_token_id`` and the
``mask_hidden`` weight through the drafter's fc (and its norms), at the positions after it, causal among
themselves after the drafter's cache."""

import pytest
import torch

from fledge.conf.schema import DrafterConfig
from fledge.evaluation.speculative import DrafterProposer
from fledge.models.algorithms import DrafterSpec, mask_token_id_for
from fledge.models.alignment import ttt_states
from fledge.models.drafter import DraftCache
from tests.helpers.models import make_drafter, packed_batch, target_config

K, MASK = 4, 7


def _one_forward(d, b, row, t):
    """The engine's draft for row ``t``: the document before t prefilled, then one forward over row t and the
    K-1 mask slots; logits ``[K, Vd]``."""
    doc = b.document_ids[row]
    start = int((doc == doc[t]).nonzero()[0])
    cache = DraftCache()
    if t > start:
        d.decode_step(b.input_ids[row, start + 1:t + 1][None], d.fuse(b.aux_hidden[row, start:t][None]),
                      b.position_ids[row, start:t][None], cache)
    slot_ids, slot_g = d.parallel_inputs(torch.zeros(1, K - 1, dtype=torch.long))
    ids = torch.cat([b.input_ids[row, t + 1].view(1, 1), slot_ids], 1)
    g = torch.cat([d.fuse(b.aux_hidden[row, t].view(1, 1, -1)), slot_g], 1)
    logits, _ = d.decode_step(ids, g, b.position_ids[row, t] + torch.arange(K)[None], cache)
    return logits[0]


def test_each_step_of_the_unroll_is_the_engines_one_forward_over_the_mask_slots():
    d, b = make_drafter(parallel_drafting=True, mask_token_id=MASK), packed_batch()
    with torch.no_grad():
        ttt = [d.lm_head(y) for y in ttt_states(d, b, K)]
        for row, t in [(0, 0), (0, 4), (0, 13), (1, 6), (1, 13)]:
            served = _one_forward(d, b, row, t)
            for k in range(K):
                torch.testing.assert_close(served[k], ttt[k][row, t], atol=1e-5, rtol=1e-5)


def test_the_slots_read_neither_the_later_tokens_nor_the_fed_back_state():
    """What makes it parallel: step k >= 1 of row t is the same whatever tokens follow t + 1 (a chain drafter's
    is not: it is fed them)."""
    b = packed_batch()
    other = packed_batch(seed=9)
    changed = b.input_ids.clone()
    changed[:, 3:] = other.input_ids[:, 3:]
    for parallel, same in ((True, True), (False, False)):
        d = make_drafter(parallel_drafting=parallel, mask_token_id=MASK)
        with torch.no_grad():
            a = d.lm_head(ttt_states(d, b, K)[2])[0, 1]
            b.input_ids, kept = changed, b.input_ids
            c = d.lm_head(ttt_states(d, b, K)[2])[0, 1]
            b.input_ids = kept
        assert torch.allclose(a, c) is same


def test_the_harness_proposes_what_the_one_forward_argmaxes():
    d, b = make_drafter(parallel_drafting=True, mask_token_id=MASK), packed_batch()
    row, t = 1, 10
    proposer = DrafterProposer(d)
    proposer.observe(b.input_ids[row, 1:t + 2].tolist(), b.aux_hidden[row, :t + 1])
    drafts, _ = proposer.propose(b.input_ids[row, :t + 2].tolist(), K)
    with torch.no_grad():
        served = _one_forward(d, b, row, t)
    assert drafts == d.draft_to_target(served.argmax(-1)).tolist()


def test_the_mask_token_is_the_given_id_else_the_targets_pad_else_its_eos():
    on = DrafterConfig(parallel_drafting=True)
    assert mask_token_id_for(DrafterConfig(parallel_drafting=True, mask_token_id=4), {"pad_token_id": 3}, 50) == 4
    assert mask_token_id_for(on, {"pad_token_id": 3, "eos_token_id": 5}, 50) == 3
    assert mask_token_id_for(on, {"pad_token_id": None, "eos_token_id": [9, 2]}, 50) == 9
    chain = DrafterSpec.from_target_config(target_config(), DrafterConfig(draft_vocab_size=40), [2, 3, 4])
    assert chain.to_dict()["mask_token_id"] is None  # a chain drafter has none
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        mask_token_id_for(on, {"eos_token_id": 77}, 50)
    with pytest.raises(ValueError, match="mask_token_id=50"):
        DrafterSpec.from_target_config(target_config(), DrafterConfig(draft_vocab_size=40, parallel_drafting=True,
                                                                      mask_token_id=50), [2, 3, 4])


@pytest.mark.parametrize("overrides, key", [
    (["drafter.mask_token_id=3"], "drafter.mask_token_id=3 is set but drafter.parallel_drafting=false"),
    (["drafter=p_eagle", "drafter.mask_token_id=-1"], "drafter.mask_token_id=-1"),
    (["drafter=p_eagle", "export.format=speculators"], "export.format=speculators"),
    (["drafter=p_eagle", "eval.engine=sglang"], "eval.engine=sglang"),
])
def test_p_eagle_keys_that_cannot_be_served_are_refused_when_composed(overrides, key):
    from fledge.conf.compose import compose

    with pytest.raises(ValueError, match=key):
        compose(["recipe=tiny", *overrides])
    assert compose(["recipe=tiny", "drafter=p_eagle"]).drafter.parallel_drafting
