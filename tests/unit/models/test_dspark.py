"""The DSpark drafter (models/dspark.py): DFlash whose anchor drafts, plus a Markov head; its training forward equals
the engine's sequential draft, the Markov head is what the sequence of picks changes, the factored head the loss
scores equals the logits, the in-process proposer drafts losslessly, and its config keys compose."""

import pytest
import torch

from fledge.models.algorithms import ALGORITHMS, DrafterSpec, algorithm_of, build_drafter
from fledge.models.dflash import DFlashSpec, block_mask
from fledge.models.dspark import DSparkDrafter, DSparkSpec
from tests.helpers.models import DFLASH_TARGET as TARGET, dflash_cfg, load_block_head, random_dspark

B = 3  # random_dspark's block: 3 tokens drafting 3


def test_spec_of_a_dspark_drafter():
    spec = DrafterSpec.from_target_config(TARGET, dflash_cfg(algorithm="dspark", block_size=5), [2, 4, 5])
    assert isinstance(spec, DSparkSpec) and isinstance(spec, DFlashSpec) and spec.algorithm == "dspark"
    assert (spec.block_size, spec.markov_rank, spec.mask_token_id, spec.layer) == (5, 256, 0, "qwen3")
    assert DrafterSpec.from_dict(spec.to_dict()) == spec  # the flat JSON, read back to its class
    entry = algorithm_of(spec)
    assert entry is ALGORITHMS.get("dspark") and entry.vllm_method == "dspark" and entry.block and entry.target_head
    assert not entry.vllm_cpu and ALGORITHMS.get("dflash").vllm_cpu
    with pytest.raises(ValueError, match="markov_rank >= 1"):
        DrafterSpec.from_target_config(TARGET, dflash_cfg(algorithm="dspark", markov_rank=0), [2, 4, 5])
    with pytest.raises(ValueError, match="DSpark block is filled with"):
        DrafterSpec.from_target_config(TARGET, dflash_cfg(algorithm="dspark", mask_token_id=300), [2, 4, 5])


def test_state_dict_is_the_served_layout():
    d = random_dspark()
    assert isinstance(d, DSparkDrafter) and d.drafts == B  # DFlash's block of 3 drafts 2
    shapes = {n: tuple(t.shape) for n, t in d.state_dict().items()}
    assert shapes["markov_head.markov_w1.weight"] == (300, 8) and shapes["markov_head.markov_w2.weight"] == (300, 8)
    assert {n for n in shapes if not n.startswith("markov_head.")} == set(build_drafter(DFlashSpec(**{
        k: v for k, v in d.spec.__dict__.items() if k != "markov_rank"})).state_dict())


def _forced(tokens):
    """A pick that takes ``tokens`` in order (teacher forcing), whatever the logits say."""
    it = iter(tokens)
    return lambda logits: torch.tensor([next(it)])


@torch.no_grad()
def test_training_forward_equals_the_engines_sequential_draft():
    """Blocks over many anchors at once under the training mask, each slot's Markov bias from the data's token before
    it, equal one block per anchor drafted as vLLM's DSparkSpeculator does, its picks forced to the data's tokens."""
    d = random_dspark()
    T = 24
    aux = torch.randn(1, T, d.spec.fc_in_features)
    pos = torch.arange(T)[None]
    doc = torch.zeros(T, dtype=torch.int32)
    doc[14:] = 1  # two packed documents; positions restart
    pos[0, 14:] = torch.arange(T - 14)
    anchors = torch.tensor([3, 9, 15, 20])
    ids = torch.randint(0, 300, (T,))
    kv = d.context_kv(d.context(aux), pos)
    bids, bpos = d.block_inputs(ids[anchors], pos[0, anchors], B)
    assert bids.shape == (4, B) and (bids[:, 1:] == d.spec.mask_token_id).all()  # the anchor, then B - 1 masks
    y = d.blocks(bids.reshape(1, -1), bpos.reshape(1, -1), kv, block_mask(anchors, doc, B)[None, None])
    p = anchors[:, None] + torch.arange(1, B + 1)
    logits = d.logits(y.view(len(anchors), B, -1), ids[p - 1])
    factored = d.head_input(y.view(len(anchors), B, -1), ids[p - 1]) @ d.head_weight(d.lm_head.weight).T
    torch.testing.assert_close(factored, logits, rtol=1e-4, atol=1e-4)  # what the loss scores
    for j, a in enumerate(anchors.tolist()):
        start = 0 if a < 14 else 14  # the anchor's document only, strictly before it
        ctx = d.context_kv(d.context(aux[:, start:a]), pos[:, start:a])
        picked, one = d.propose(ids[a:a + 1], pos[0, a:a + 1], ctx, B, _forced(ids[a + 1:a + 1 + B].tolist()))
        assert picked[0].tolist() == ids[a + 1:a + 1 + B].tolist()
        torch.testing.assert_close(logits[j], one[0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_each_slot_is_biased_by_the_token_picked_before_it():
    d = random_dspark()
    aux = torch.randn(1, 10, d.spec.fc_in_features)
    kv = d.context_kv(d.context(aux), torch.arange(10)[None])
    bonus, at = torch.tensor([7]), torch.tensor([10])
    greedy, logits = d.propose(bonus, at, kv, B)
    assert torch.equal(greedy, logits.argmax(-1)) and torch.equal(d.draft(bonus, at, kv, B), logits)
    _, other = d.propose(bonus, at, kv, B, _forced([int(greedy[0, 0]) + 1, 0, 0]))
    torch.testing.assert_close(other[:, 0], logits[:, 0])  # slot 0 reads the anchor only
    assert (other[:, 1] - logits[:, 1]).abs().max() > 1e-3  # slot 1 reads slot 0's pick
    base = d.lm_head(d.blocks(*d.block_inputs(bonus, at, B), kv, None))
    torch.testing.assert_close(logits[:, 0], base[:, 0] + d.markov_head(bonus))
    d.markov_head.markov_w2.weight.zero_()  # no Markov bias: DFlash's parallel logits of the anchor-drafting block
    torch.testing.assert_close(d.draft(bonus, at, kv, B), base)


@pytest.mark.parametrize("draft_vocab", [96, 40])  # the random target's whole vocab, and a draft vocab of 40 ids
def test_the_in_process_proposer_drafts_a_whole_block_losslessly(draft_vocab):
    from fledge.evaluation.speculative import (
        BlockProposer,
        TargetRunner,
        greedy_decode,
        proposer_for,
        speculative_decode,
    )
    from tests.helpers.models import random_llama

    target = random_llama()
    cfg = dflash_cfg(algorithm="dspark", block_size=B, markov_rank=8, mask_token_id=3, num_draft_layers=1,
                     draft_vocab_size=draft_vocab)
    spec = DrafterSpec.from_target_config(target.config, cfg, [2, 3, 4])
    torch.manual_seed(0)
    d = build_drafter(spec)
    load_block_head(d, target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    prop = proposer_for(d.eval())
    assert isinstance(prop, BlockProposer)
    runner, plain = TargetRunner(target, spec.aux_layer_ids), TargetRunner(target)
    prompt = [1, 5, 9, 13, 5, 9, 13, 7]
    res = speculative_decode(runner, prop, prompt, B, 30)
    assert res.tokens == greedy_decode(plain, prompt, 30)[0]
    assert all(r.drafted == B for r in res.rounds if not r.budget_limited)
    g = torch.Generator().manual_seed(0)
    drafts, q = prop.propose(None, B, 1.0, g)
    assert len(drafts) == B and q.shape == (B, target.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(B)) and all(q[j, t] > 0 for j, t in enumerate(drafts))
    assert all(d.t2d[t] for t in drafts) and int((q > 0).sum(-1).max()) <= draft_vocab  # target ids of the vocab


@pytest.mark.parametrize("overrides, key", [
    (["drafter=dspark", "drafter.block_size=8"], "eval.draft_tokens=5 with drafter.block_size=8: a DSpark block"),
    (["drafter=dspark", "drafter.norm_output=true"], "drafter.algorithm=dspark has none of EAGLE's flags"),
    (["drafter=dspark", "export.format=speculators"], "Qwen3DSparkModel"),
    (["drafter=dspark", "eval.engine=sglang"], "eval.engine=sglang"),
    (["drafter=dspark", "train.sequence_parallel=2"], "train.sequence_parallel=2"),
])
def test_dspark_keys_that_cannot_be_trained_or_served_are_refused_when_composed(overrides, key):
    from fledge.conf.compose import compose

    with pytest.raises(ValueError, match=key):
        compose(["recipe=tiny", *overrides])


def test_dspark_composes_over_a_recipe_with_the_eval_draft_length_as_its_block():
    from fledge.conf.compose import compose

    d = compose(["recipe=tiny", "drafter=dspark", "drafter.mask_token_id=5"]).drafter
    assert (d.algorithm, d.block_size, d.draft_steps(), d.mask_token_id, d.position_decay) == ("dspark", 5, 5, 5, 4.0)
    assert compose(["recipe=tiny", "drafter=dspark", "eval.draft_tokens=7"]).drafter.block_size == 7
    rank = compose(["recipe=tiny", "drafter=dspark", "drafter.markov_rank=64", "drafter.draft_vocab_size=300"]).drafter
    assert DrafterSpec.from_target_config(TARGET, rank, [2, 4, 5]).markov_rank == 64


def test_the_markov_rank_moves_the_train_hash_only_off_its_default():
    """drafter.markov_rank came after the recorded runs (tests/unit/pipeline/test_recorded_inputs.py): at its
    default it stays out of the train stage's hash, as those runs' manifests have it."""
    from fledge.conf.compose import compose
    from fledge.pipeline.stages import train_inputs
    from fledge.stage_inputs import hashed

    def drafter_hash(*ov):
        return hashed(train_inputs(compose(["recipe=tiny", "drafter=dspark", *ov])))["drafter"]

    assert "markov_rank" not in drafter_hash() and drafter_hash("drafter.markov_rank=64")["markov_rank"] == 64
