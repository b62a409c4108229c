"""The tiny MoE (Qwen3-MoE) and MLA (DeepSeek-V3) targets' shapes go through what Fledge reads of a target:
the family registry, FrozenTarget's capture, the teacher rows (tied head for moe), the serving config and the
linter. Untrained models of the real shapes (testbed/tiny_families.py), saved and loaded as the recipes do;
seconds, no training."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fledge.conf.schema import DrafterConfig, TargetConfig
from fledge.models.families import read_target
from fledge.models.target import FrozenTarget
from fledge.models.weights import load_input_embeddings, load_lm_head_rows
from fledge.serving.export import write_drafter
from fledge.serving.lint import format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import serving_config
from fledge.testbed import tiny_families
from tests.helpers.models import random_state_dict


class _Tok:  # the special ids new_model copies (the tiny tokenizer's)
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0


@pytest.fixture(scope="module", params=sorted(tiny_families.SHAPES))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_families.new_model(request.param, _Tok())
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return request.param, out, model.eval()


def test_family_and_shape(saved):
    family, path, _ = saved
    cfg = json.loads((path / "config.json").read_text())
    fam, shape = read_target(cfg)
    want = {"moe": "qwen3_moe", "mla": "deepseek_v3"}[family]
    assert fam.name == want and shape.hidden_size == 128 and shape.num_hidden_layers == 8
    assert shape.intermediate_size == 256  # the dense width, not moe_intermediate_size (64)
    if family == "mla":
        assert shape.head_dim == 32 and shape.mla["kv_lora_rank"] + shape.mla["qk_rope_head_dim"] == 576
        assert shape.rope_scaling["rope_type"] == "yarn" and shape.rope_scaling["mscale_all_dim"] == 1.0
        assert not shape.tie_word_embeddings
    else:
        assert shape.head_dim == 32 and shape.tie_word_embeddings and shape.mla is None


def test_capture_states_and_teacher_rows(saved):
    family, path, model = saved
    tcfg = TargetConfig(name_or_path=str(path), dtype="float32", num_hidden_layers=8, hidden_size=128,
                        vocab_size=tiny_families.SHAPES[family]["vocab_size"])
    frozen = FrozenTarget.load(tcfg, torch.device("cpu"), [2, 4, 5])
    V = tiny_families.SHAPES[family]["vocab_size"]
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(1))
    aux, final, argmax = frozen.capture(ids)
    ref = model(input_ids=ids, output_hidden_states=True)
    hs = ref.hidden_states
    torch.testing.assert_close(aux, torch.cat([hs[2], hs[4], hs[5]], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, hs[-1], rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, ref.logits.argmax(-1))
    rows = torch.tensor([V - 1, 3, 17])
    head = load_lm_head_rows(path, None, rows)
    torch.testing.assert_close(head.float(), model.lm_head.weight[rows].float())
    emb = load_input_embeddings(path)
    assert torch.equal(head, emb[rows]) == (family == "moe")  # tied only for moe


def test_export_lints_clean_against_the_tiny_target(saved, tmp_path):
    family, path, _ = saved
    target = json.loads((path / "config.json").read_text())
    config = serving_config(target, DrafterConfig(draft_vocab_size=256), [2, 4, 5], 256, target_name=str(path))
    # The family's default layer kind: the MLA layer for the DeepSeek-V3-shaped target, with its own widths.
    arch = {"moe": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}[family]
    assert config["architectures"] == [arch] and config["hidden_size"] == 128
    if family == "mla":
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        assert latent == target["kv_lora_rank"] + target["qk_rope_head_dim"]
    out = write_drafter(tmp_path / "drafter", random_state_dict(config), config)
    findings = lint_drafter(out, target)
    assert not has_errors(findings), format_findings(findings)
    assert has_errors(lint_drafter(out, {**target, "rms_norm_eps": 1e-5}))  # negative control


def test_loads_with_auto_class(saved):
    _, path, model = saved
    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(again) is type(model)
