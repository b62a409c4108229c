"""The tiny MLA target's MTP module (testbed/tiny_mtp.py) on an untrained model of its shape: the joint objective's
alignment and schedule, the checkpoint the target is saved as (what transformers, Fledge's readers and
load_mtp take from it), and the in-process speculative decoding its served acceptance is compared with."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fledge.models.families import read_target
from fledge.models.mtp import load_mtp
from fledge.models.weights import input_embedding_name, lm_head_name, weight_map
from fledge.testbed import tiny_families, tiny_mtp, tiny_target


class _Tok:  # what _save_model and new_model read of the tiny tokenizer
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def save_pretrained(self, path):
        pass


@pytest.fixture(scope="module")
def joint():
    torch.manual_seed(0)
    return tiny_mtp.TargetWithMTP(tiny_families.new_model("mla_mtp", _Tok())).eval()


@pytest.fixture(scope="module")
def saved(joint, tmp_path_factory):
    path = tmp_path_factory.mktemp("mla_mtp")
    tiny_target._save_model(joint.target, _Tok(), path)  # in place: the target (and the shared tensors) to bf16
    tiny_mtp.add_mtp_tensors(path, joint.mtp)
    joint.mtp.to(torch.bfloat16)  # all of it in bf16, as saved, then back: the tests after compare with the file
    joint.float()
    return path


def test_lambda_is_deepseeks_schedule_over_the_steps():
    assert tiny_mtp.mtp_weight(0.0) == 0.3 and tiny_mtp.mtp_weight(0.67) == 0.3
    assert tiny_mtp.mtp_weight(0.68) == 0.1 and tiny_mtp.mtp_weight(0.99) == 0.1


@torch.no_grad()
def test_the_module_predicts_two_tokens_on_from_the_targets_hidden_state(joint):
    """Loss on one answer token x[j + 1] (mask column j): the main term scores x[j + 1] from position j, the
    module's scores it from slot j - 1 (h_{j-1}, token j), weighted by lambda."""
    x = torch.randint(3, 2560, (1, 13), generator=torch.Generator().manual_seed(3))
    mask, j = torch.zeros(1, 12), 6
    mask[0, j] = 1
    h = joint.target.model(input_ids=x[:, :-1]).last_hidden_state
    main = F.cross_entropy(joint.target.lm_head(h[0, j]), x[0, j + 1])
    _, logits = joint.mtp(h[:, :-1], x[:, 1:-1])
    extra = F.cross_entropy(logits[0, j - 1], x[0, j + 1])
    for progress, lam in ((0.0, 0.3), (0.9, 0.1)):
        torch.testing.assert_close(joint.training_loss(x, mask, progress), main + lam * extra)


def test_the_modules_loss_reaches_the_targets_layers(joint):
    x = torch.randint(3, 2560, (1, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(1, 8)
    joint.zero_grad()
    (joint.training_loss(x, mask, 0.0) - tiny_mtp.masked_ce(joint.target(input_ids=x[:, :-1]).logits, x[:, 1:],
                                                           mask)).backward()
    assert joint.target.model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum() > 0  # the trunk learns for it
    assert joint.mtp.eh_proj.weight.grad.abs().sum() > 0
    joint.zero_grad()


def test_the_saved_target_carries_its_module_where_vllm_reads_it(joint, saved):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 8
    assert read_target(cfg)[1].mtp_layers == 1
    names = weight_map(saved)
    assert "model.layers.8.eh_proj.weight" in names and "model.layers.8.mlp.experts.7.down_proj.weight" in names
    # Fledge's readers take the target's own embedding and head, not the module's copies
    assert input_embedding_name(names) == "model.embed_tokens.weight" and lm_head_name(names) == "lm_head.weight"
    ids = torch.randint(3, 2560, (1, 10), generator=torch.Generator().manual_seed(5))
    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, joint.target(input_ids=ids).logits)
        h = loaded.model(input_ids=ids).last_hidden_state
        mtp = load_mtp(saved)
        torch.testing.assert_close(mtp(h[:, :-1], ids[:, 1:])[1], joint.mtp(h[:, :-1], ids[:, 1:])[1])


def test_a_target_without_a_module_is_refused(tmp_path):
    torch.manual_seed(0)
    tiny_target._save_model(tiny_families.new_model("mla", _Tok()), _Tok(), tmp_path)
    with pytest.raises(ValueError, match="no num_nextn_predict_layers"):
        load_mtp(tmp_path)


@torch.no_grad()
def test_in_process_speculative_decoding_is_lossless_and_counts_as_vllm(joint, monkeypatch):
    target, prompts, k = joint.target, [[1, 5, 9, 40], [1, 7, 7, 300, 12]], 2
    plain = [target.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, len(p):].tolist()
             for p in prompts]
    got = tiny_mtp.chain_acceptance(target, joint.mtp, prompts, k, 7, stop_ids=[])
    assert got["outputs"] == plain and got["accepted"] == sum(got["accepted_per_pos"])

    def oracle(mtp, hidden, ids, k):  # the target's own greedy continuation: every draft accepted
        return target.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False)[0, len(ids):].tolist()

    monkeypatch.setattr(tiny_mtp, "draft_chain", oracle)
    got = tiny_mtp.chain_acceptance(target, joint.mtp, prompts, k, 7, stop_ids=[])
    assert got["outputs"] == plain and got["accepted_per_pos"] == [got["drafts"]] * k
    assert got["drafts"] == 2 * 2  # 1 + 3 + 3 tokens: two rounds a prompt
