"""DSpark's export (serving/dspark_layout.py): the layout vLLM's Qwen3DSparkForCausalLM reads (DFlash's with vLLM's
DSpark keys), read back to the same drafter, served with num_speculative_tokens = its block, and the linter's findings
for what vLLM would serve silently wrong: a k other than the block, the mask token and layer ids as vLLM reads them
(stray keys it reads first included), the anchor drafting, the Markov head, max_position_embeddings."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.models.algorithms import ALGORITHMS
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.serving import dspark_layout
from fledge.serving.engine import check_engine, speculative_config
from fledge.serving.export import export_checkpoint, load_drafter, spec_from_export
from fledge.serving.lint import format_findings, lint_drafter
from tests.helpers.models import DFLASH_TARGET as TARGET, random_dspark


@pytest.fixture
def export(tmp_path):
    d = random_dspark(mask_token_id=5)
    ckpt = DrafterCheckpoint(d.spec, target={"name_or_path": "t"}, step=3).write(tmp_path / "ckpt", d.state_dict())
    config = export_checkpoint(ckpt, tmp_path / "out", TARGET)
    return d, config, tmp_path / "out"


def _errors(out, k=None):
    return {f.code for f in lint_drafter(out, TARGET, k) if f.level == "error"}


def _edit(out, **changes):
    path = out / "config.json"
    c = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    path.write_text(json.dumps(c))
    return c


def test_a_draft_vocab_ships_what_vllms_reduced_dspark_requires(tmp_path):
    """vLLM 0.32's Qwen3DSparkForCausalLM refuses a reduced vocab without lm_head rows and d2t; its Markov w2 is a
    bias over the draft vocab while w1 reads the previous target id."""
    d = random_dspark(mask_token_id=5, draft_vocab_size=40)
    ckpt = DrafterCheckpoint(d.spec, target={"name_or_path": "t"}, step=3).write(tmp_path / "ckpt", d.state_dict())
    c = export_checkpoint(ckpt, tmp_path / "out", TARGET)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert c["draft_vocab_size"] == 40 and tensors["lm_head.weight"].shape == (40, 64)
    assert torch.equal(tensors["d2t"], d.d2t)
    assert tensors["markov_head.markov_w1.weight"].shape == (300, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (40, 8)
    findings = lint_drafter(tmp_path / "out", TARGET, 3)
    assert not [f for f in findings if f.level == "error"], format_findings(findings)
    loaded = load_drafter(tmp_path / "out", embed_weight=d.embed_tokens.weight.detach(), serving=True)
    torch.manual_seed(0)
    aux, pos = torch.randn(1, 6, 3 * 64), torch.arange(6)[None]
    want, _ = d.propose(torch.tensor([7]), torch.tensor([6]), d.context_kv(d.context(aux), pos), 3)
    got, _ = loaded.propose(torch.tensor([7]), torch.tensor([6]), loaded.context_kv(loaded.context(aux), pos), 3)
    assert torch.equal(want, got) and bool(d.t2d[got].all())


def test_config_is_what_vllm_reads(export):
    d, c, out = export
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
    assert (c["target_layer_ids"], c["mask_token_id"], c["block_size"]) == ([1, 3, 4], 5, 3)
    assert c["sample_from_anchor"] is True and c["markov_rank"] == 8 and c["markov_head_type"] == "vanilla"
    assert c["enable_confidence_head"] is False and c["max_position_embeddings"] == 512
    assert "dflash_config" not in c and "eagle_aux_hidden_state_layer_ids" not in c and "eagle_config" not in c
    assert c["use_sliding_window"] is False and c["layer_types"] == ["full_attention"] * 2
    tensors = load_file(out / "model.safetensors")
    assert tensors["markov_head.markov_w1.weight"].shape == (300, 8) and "lm_head.weight" not in tensors
    assert set(tensors) == {n for n in dspark_layout.expected_tensors(c) if not n.startswith("optional:")}
    findings = lint_drafter(out, TARGET, 3)
    assert not [f for f in findings if f.level != "note"], format_findings(findings)  # no DFlash CPU k_norm warning
    assert speculative_config("eagle3", 3, out) == {"method": "dspark", "model": str(out.resolve()),
                                                   "num_speculative_tokens": 3}


def test_read_back_as_served(export):
    d, _, out = export
    assert spec_from_export(out, serving=True) == d.spec  # from config.json alone, as vLLM builds it
    loaded = load_drafter(out, embed_weight=d.embed_tokens.weight.detach(), head_weight=d.lm_head.weight.detach(),
                          serving=True)
    torch.manual_seed(0)
    aux = torch.randn(1, 6, 3 * 64)
    pos = torch.arange(6)[None]
    forced = lambda: iter([11, 22, 33])  # noqa: E731 (the same picks on both: bf16 may flip a near tie)
    with torch.no_grad():
        it = forced()
        _, want = d.propose(torch.tensor([7]), torch.tensor([6]), d.context_kv(d.context(aux), pos), 3,
                            lambda _: torch.tensor([next(it)]))
        it = forced()
        _, got = loaded.propose(torch.tensor([7]), torch.tensor([6]), loaded.context_kv(loaded.context(aux), pos), 3,
                                lambda _: torch.tensor([next(it)]))
    assert torch.allclose(want, got, atol=0.05, rtol=0.05)  # bf16 export


@pytest.mark.parametrize("change,code", [
    ({"mask_token_id": 0}, "dspark-mask-token"),
    ({"mask_token_id": None}, "dspark-mask-token"),
    ({"dflash_config": {"mask_token_id": 0}}, "dspark-mask-token"),  # vLLM reads it before mask_token_id
    ({"target_layer_ids": [2, 4, 5]}, "dspark-layer-ids"),  # the boundary ids, unshifted
    ({"dspark_target_layer_ids": [0, 1, 2]}, "dspark-layer-ids"),  # read before target_layer_ids
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, "dspark-eagle-ids"),
    ({"block_size": 5}, "dspark-block-size"),
    ({"sample_from_anchor": False}, "dspark-sample-from-anchor"),
    ({"dflash_config": {"sample_from_anchor": True}}, "dspark-sample-from-anchor"),
    ({"markov_rank": 16}, "dspark-markov"),
    ({"markov_head_type": "gated"}, "dspark-markov"),
    ({"max_position_embeddings": 256}, "max-positions-trained"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "dspark-causal"),
    ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "num-layers"),
    ({"architectures": ["DSparkDraftModel"]}, "architecture"),
])
def test_lint_catches_what_serves_silently_wrong(export, change, code):
    _, _, out = export
    _edit(out, **change)
    assert code in _errors(out)


def test_lint_catches_a_k_other_than_the_block_and_wrong_tensors(export, tmp_path):
    from fledge.serving.lint import main

    _, _, out = export
    assert "num-speculative-tokens" in _errors(out, 5) and "num-speculative-tokens" not in _errors(out, 3)
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    assert main([str(out), "--target", str(tmp_path / "target.json"), "--num-speculative-tokens", "5"]) == 1
    assert main([str(out), "--target", str(tmp_path / "target.json"), "--num-speculative-tokens", "3"]) == 0
    tensors = load_file(out / "model.safetensors")
    tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][:, :4].contiguous()
    del tensors["markov_head.markov_w1.weight"]
    save_file(tensors, out / "model.safetensors")
    assert {"missing-tensor", "shape"} <= _errors(out)


def test_the_card_serves_it_with_vllms_dspark_method_at_its_block(export):
    from fledge.serving.card import build_model_card

    _, _, out = export
    text = str(build_model_card(out, "org/tiny-dspark", speculative_tokens=3)[0])
    assert '"method": "dspark", "model": "org/tiny-dspark", "num_speculative_tokens": 3' in text
    assert "Qwen3DSparkModel" in text and "serve exactly 3 speculative tokens" in text and "[1, 3, 4]" in text
    assert "eagle3" not in text and "sglang.launch_server" not in text


def test_vllms_cpu_build_is_refused_before_any_work_with_the_fix():
    with pytest.raises(ValueError, match="drafter.algorithm=dspark on cpu: vLLM 0.32 runs its dspark method only in "
                                         "its V2 model runner.*use eval.engine=hf here"):
        check_engine("vllm", "cpu", "/nonexistent/python", ALGORITHMS.get("dspark"))
    assert check_engine("hf", "cpu", None, ALGORITHMS.get("dspark")) is None
