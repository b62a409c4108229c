"""DeepSeek-V3's MTP module (models/mtp.py) on an untrained target of the tiny MLA shape: its checkpoint names are
the real DeepSeek-V3's MTP layer (tests/fixtures/tensor_names/, the names vLLM's deepseek_mtp.py reads), they map
back to the module, its forward is vLLM's formula, and draft_chain feeds back what vLLM's proposer does."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fledge.models.mtp import MTPModule, checkpoint_tensors, draft_chain, module_state_dict
from fledge.testbed import tiny_families
from tests.helpers.paths import FIXTURES


class _Tok:  # the special ids new_model copies (the tiny tokenizer's)
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0


@pytest.fixture(scope="module")
def target_and_mtp():
    torch.manual_seed(0)
    target = tiny_families.new_model("mla_mtp", _Tok()).eval()
    return target, MTPModule(target.config, target.model.embed_tokens, target.lm_head).eval()


def test_checkpoint_names_are_deepseek_v3s_mtp_layer(target_and_mtp):
    _, mtp = target_and_mtp
    names = checkpoint_tensors(mtp)
    assert mtp.layer_index == 8 and all(n.startswith("model.layers.8.") for n in names)
    # DeepSeek-V3's layer 61 (61 decoder layers, 256 experts: the fixture keeps experts 0 and 255 only)
    real = {n for n in json.loads((FIXTURES / "tensor_names" / "deepseek_v3.json").read_text())["names"]
            if n.startswith("model.layers.61.") and not n.endswith("weight_scale_inv")}
    ours = {re.sub(r"experts\.7\.", "experts.255.", n.replace("layers.8.", "layers.61."))
            for n in names if not re.search(r"experts\.[1-6]\.", n)}
    assert ours == real


def test_checkpoint_tensors_map_back_to_the_module(target_and_mtp):
    _, mtp = target_and_mtp
    tensors = checkpoint_tensors(mtp)
    assert tensors["model.layers.8.mlp.experts.3.up_proj.weight"].shape == (64, 128)  # moe_intermediate x hidden
    state = module_state_dict(tensors, 8)
    own = mtp.state_dict()
    assert set(own) - set(state) == {"embed_tokens.weight", "shared_head.head.weight"}  # the target's, shared
    assert all(torch.equal(state[n], own[n]) for n in state)
    # the copies written beside the layer are the target's own embedding and head
    assert torch.equal(tensors["model.layers.8.embed_tokens.weight"], mtp.embed_tokens.weight)
    assert torch.equal(tensors["model.layers.8.shared_head.head.weight"], mtp.shared_head.head.weight)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def test_forward_is_vllms_deepseek_mtp_layer(target_and_mtp):
    """vLLM's DeepSeekMultiTokenPredictorLayer.forward written out: the embedding zeroed at position 0, then
    eh_proj([enorm(e), hnorm(h)]), the decoder block, and logits from shared_head.norm of its output."""
    target, mtp = target_and_mtp
    ids = torch.randint(3, 2560, (2, 9), generator=torch.Generator().manual_seed(1))
    h = target.model(input_ids=ids).last_hidden_state
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12]])
    out, logits = mtp(h[:, :-1], ids[:, 1:], position_ids=pos)
    e = target.model.embed_tokens(ids[:, 1:]) * (pos != 0).unsqueeze(-1)
    x = torch.cat([_rms(e, mtp.enorm.weight), _rms(h[:, :-1], mtp.hnorm.weight)], -1) @ mtp.eh_proj.weight.T
    from transformers.masking_utils import create_causal_mask

    mask = create_causal_mask(config=target.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                              position_ids=pos)
    ref = mtp.mtp_block(x, attention_mask=mask, position_ids=pos, position_embeddings=mtp.rotary_emb(x, pos))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(logits, _rms(ref, mtp.shared_head.norm.weight) @ target.lm_head.weight.T)
    other = ids[:, 1:].clone()
    other[:, 0] += 1
    changed, _ = mtp(h[:, :-1], other, position_ids=pos)
    assert torch.equal(changed[0], out[0])  # the token at position 0 is not read
    assert not torch.equal(changed[1, 0], out[1, 0])  # at position 5 it is


@torch.no_grad()
def test_draft_chain_feeds_back_the_normed_output_one_position_on(target_and_mtp):
    target, mtp = target_and_mtp
    ids = torch.randint(3, 2560, (1, 7), generator=torch.Generator().manual_seed(2))[0].tolist()
    h = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    drafts = draft_chain(mtp, h, ids, 3)
    # step by step: slots 0..5 read the target (h_t, token t+1); slot 6 the fed-back state and draft 1; ...
    hidden, tokens = h[None, :6], ids[1:]
    for d in drafts:
        out, logits = mtp(hidden, torch.tensor([tokens]))
        assert int(logits[0, -1].argmax()) == d
        hidden, tokens = torch.cat([hidden, _rms(out[:, -1:], mtp.shared_head.norm.weight)], 1), tokens + [d]
    assert len(drafts) == 3
