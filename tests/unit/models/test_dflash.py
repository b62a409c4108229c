"""The DFlash drafter (models/dflash.py): the training forward over many anchors equals the engine-style draft of one
block over its verified context; the block mask; the spec's rules; the layer-id conventions."""

from types import SimpleNamespace

import pytest
import torch

from fledge.models.algorithms import ALGORITHMS, DrafterSpec, build_drafter
from fledge.models.dflash import aux_layer_ids_of, block_mask, serving_layer_ids
from fledge.models.drafter import Eagle3Drafter
from tests.helpers.models import DFLASH_TARGET as TARGET, dflash_cfg, random_dflash


def test_spec_of_a_dflash_drafter():
    spec = DrafterSpec.from_target_config(TARGET, dflash_cfg(), [2, 4, 5])
    assert (spec.algorithm, spec.layer, spec.block_size, spec.num_draft_layers) == ("dflash", "qwen3", 4, 2)
    assert spec.draft_vocab_size == 300  # dflash_cfg's: the target's whole vocab
    assert DrafterSpec.from_target_config(TARGET, dflash_cfg(draft_vocab_size=32), [2, 4, 5]).draft_vocab_size == 32
    with pytest.raises(ValueError, match="draft_vocab_size=301: must be in"):
        DrafterSpec.from_target_config(TARGET, dflash_cfg(draft_vocab_size=301), [2, 4, 5])
    assert spec.mask_token_id == 0  # the target's pad id by default
    assert DrafterSpec.from_dict(spec.to_dict()) == spec
    # the flat JSON every spec is written as holds EAGLE's flags at false; one set is refused, not dropped
    assert {k: spec.to_dict()[k] for k in ("fc_norm", "norm_output", "parallel_drafting")} == dict.fromkeys(
        ("fc_norm", "norm_output", "parallel_drafting"), False)
    with pytest.raises(ValueError, match="'fc_norm': True.*dflash does not have"):
        DrafterSpec.from_dict({**spec.to_dict(), "fc_norm": True})
    assert not hasattr(spec, "fc_norm")
    assert DrafterSpec.from_target_config(TARGET, dflash_cfg(mask_token_id=7), [2, 4, 5]).mask_token_id == 7
    with pytest.raises(ValueError, match="mask_token_id=300"):
        DrafterSpec.from_target_config(TARGET, dflash_cfg(mask_token_id=300), [2, 4, 5])
    assert isinstance(build_drafter(DrafterSpec.from_target_config(
        TARGET, SimpleNamespace(fc_norm=True, norm_output=True, norm_before_fc=False, draft_vocab_size=32), [2, 4, 5])),
        Eagle3Drafter)
    assert {a.vllm_method for a in ALGORITHMS.values()} == {"eagle3", "dflash", "dspark", "mtp"}


def test_state_dict_is_the_served_layout():
    names = set(random_dflash().state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith(("midlayer.", "model.")) or n in ("d2t", "t2d", "mask_hidden") for n in names)
    assert {"embed_tokens.weight", "lm_head.weight"} <= names  # the target's, frozen: the export leaves them out
    small = random_dflash(draft_vocab_size=32)  # a draft vocab: its rows and map are the drafter's own
    sd = small.state_dict()
    assert sd["lm_head.weight"].shape == (32, 64) and sd["d2t"].shape == (32,) and sd["t2d"].shape == (300,)
    assert not small.lm_head.weight.requires_grad and int(sd["t2d"].sum()) == 32


def test_layer_id_conventions():
    # boundary id b = HF hidden_states[b] = the output of 0-based layer b - 1, which DFlash's target_layer_ids name
    assert serving_layer_ids([2, 15, 27]) == [1, 14, 26]
    assert aux_layer_ids_of(serving_layer_ids([2, 15, 27])) == [2, 15, 27]


def test_block_mask():
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    m = block_mask(torch.tensor([2, 6]), doc, 3)
    assert m.shape == (6, 8 + 6)
    assert m[:3, :8].tolist() == [[True, True, False, False, False, False, False, False]] * 3  # before anchor 2, doc 0
    assert m[3:, :8].tolist() == [[False, False, False, False, True, True, False, False]] * 3  # doc 1, before 6
    assert m[:3, 8:11].all() and not m[:3, 11:].any() and m[3:, 11:].all() and not m[3:, 8:11].any()


@torch.no_grad()
def test_training_forward_equals_engine_draft():
    d = random_dflash()
    T, B = 24, 4
    aux = torch.randn(1, T, d.spec.fc_in_features)
    pos = torch.arange(T)[None]
    doc = torch.zeros(T, dtype=torch.int32)
    doc[14:] = 1  # two packed documents; positions restart
    pos[0, 14:] = torch.arange(T - 14)
    anchors = torch.tensor([3, 9, 15, 20])
    ids = torch.randint(0, 300, (T,))
    kv = d.context_kv(d.context(aux), pos)
    bids = torch.full((len(anchors), B), d.spec.mask_token_id)
    bids[:, 0] = ids[anchors]
    bpos = pos[0, anchors][:, None] + torch.arange(B)
    y = d.blocks(bids.reshape(1, -1), bpos.reshape(1, -1), kv, block_mask(anchors, doc, B)[None, None])
    logits = d.lm_head(y.view(len(anchors), B, -1)[:, 1:])
    for j, a in enumerate(anchors.tolist()):
        start = 0 if a < 14 else 14  # the anchor's document only, strictly before it
        ctx = d.context_kv(d.context(aux[:, start:a]), pos[:, start:a])
        one = d.draft(ids[a:a + 1], pos[0, a:a + 1], ctx, B - 1)
        torch.testing.assert_close(logits[j], one[0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_every_slot_depends_on_the_context_and_the_bonus_token():
    d = random_dflash()
    aux = torch.randn(1, 10, d.spec.fc_in_features)
    kv = d.context_kv(d.context(aux), torch.arange(10)[None])
    base = d.draft(torch.tensor([7]), torch.tensor([10]), kv, 3)
    kv2 = d.context_kv(d.context(aux * 2 + 1), torch.arange(10)[None])
    assert (d.draft(torch.tensor([7]), torch.tensor([10]), kv2, 3) - base).abs().amax(-1).min() > 1e-4
    assert (d.draft(torch.tensor([8]), torch.tensor([10]), kv, 3) - base).abs().amax(-1).min() > 1e-4


@pytest.mark.parametrize("overrides, key", [
    (["drafter=dflash", "drafter.block_size=1"], "drafter.block_size=1"),
    (["drafter=dflash", "drafter.fc_norm=true"], "none of EAGLE's flags"),
    (["drafter=dflash", "export.format=speculators"], "export.format=speculators"),
    (["drafter=dflash", "eval.engine=sglang"], "eval.engine=sglang"),
    (["drafter=dflash", "train.sequence_parallel=2"], "train.sequence_parallel=2"),
    (["drafter=dflash", "drafter.block_size=4"], "eval.draft_tokens=5 with drafter.block_size=4"),
    (["drafter.algorithm=medusa"], "drafter.algorithm='medusa'"),
])
def test_dflash_keys_that_cannot_be_trained_or_served_are_refused_when_composed(overrides, key):
    from fledge.conf.compose import compose

    with pytest.raises(ValueError, match=key):
        compose(["recipe=tiny", *overrides])


def test_dflash_composes_over_a_recipe():
    from fledge.conf.compose import compose

    cfg = compose(["recipe=tiny", "drafter=dflash", "drafter.block_size=8", "drafter.mask_token_id=5"])
    d = cfg.drafter
    assert (d.algorithm, d.block_size, d.draft_steps(), d.mask_token_id) == ("dflash", 8, 7, 5)
    assert compose(["recipe=tiny"]).drafter.draft_steps() == compose(["recipe=tiny"]).drafter.ttt_steps
