"""DFlash's export (serving/dflash_layout.py): the layout vLLM's DFlashQwen3ForCausalLM reads, read back to the same
drafter, and the linter's findings for the silent failures behind the peers' AL ~1 DFlash reports."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.serving import dflash_layout
from fledge.serving.engine import speculative_config
from fledge.serving.export import export_checkpoint, load_drafter, spec_from_export
from fledge.serving.lint import format_findings, has_errors, lint_drafter
from tests.helpers.models import DFLASH_TARGET as TARGET, random_dflash


@pytest.fixture
def export(tmp_path):
    d = random_dflash(mask_token_id=5)
    ckpt = DrafterCheckpoint(d.spec, target={"name_or_path": "t"}, step=3).write(tmp_path / "ckpt", d.state_dict())
    config = export_checkpoint(ckpt, tmp_path / "out", TARGET)
    return d, config, tmp_path / "out"


def _codes(out):
    return {f.code for f in lint_drafter(out, TARGET) if f.level == "error"}


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


def test_config_is_what_vllm_reads(export):
    d, c, out = export
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["num_hidden_layers"] == 2 and c["head_dim"] == 16 and c["block_size"] == 4
    assert c["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 4], "block_size": 4}
    assert "eagle_config" not in c and "eagle_aux_hidden_state_layer_ids" not in c and "draft_vocab_size" not in c
    assert c["use_sliding_window"] is False and c["layer_types"] == ["full_attention"] * 2
    assert c["num_target_layers"] == 8 and c["rope_parameters"]["rope_theta"] == c["rope_theta"]
    tensors = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors  # vLLM shares the target's
    assert "mask_hidden" not in tensors and "d2t" not in tensors
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["fc.weight"].dtype == torch.bfloat16
    assert set(tensors) == {n for n in dflash_layout.expected_tensors(c) if not n.startswith("optional:")}
    findings = lint_drafter(out, TARGET)
    assert not has_errors(findings), format_findings(findings)
    # two layers with their own k_norm: served right on a GPU only (vLLM 0.32's CPU kernel takes layer 0's)
    assert [f.code for f in findings if f.level == "warning"] == ["dflash-cpu-k-norm"]
    assert speculative_config("eagle3", 3, out) == {"method": "dflash", "model": str(out.resolve()),
                                                   "num_speculative_tokens": 3}


def test_read_back_as_served(export):
    d, c, out = export
    assert spec_from_export(out, serving=True) == d.spec  # from config.json alone, as vLLM builds it
    loaded = load_drafter(out, embed_weight=d.embed_tokens.weight.detach(), head_weight=d.lm_head.weight.detach(),
                          serving=True)
    torch.manual_seed(0)
    aux = torch.randn(1, 6, 3 * 64)
    pos = torch.arange(6)[None]
    want = d.draft(torch.tensor([7]), torch.tensor([6]), d.context_kv(d.context(aux), pos), 3)
    got = loaded.draft(torch.tensor([7]), torch.tensor([6]), loaded.context_kv(loaded.context(aux), pos), 3)
    assert torch.allclose(want, got, atol=0.05, rtol=0.05)  # bf16 export
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    with pytest.raises(ValueError, match="lm_head"):
        load_drafter(out, embed_weight=d.embed_tokens.weight.detach())


@pytest.fixture
def small_vocab(tmp_path):
    """A DFlash drafter over 32 of the target's 300 ids, exported."""
    d = random_dflash(mask_token_id=5, draft_vocab_size=32)
    ckpt = DrafterCheckpoint(d.spec, target={"name_or_path": "t"}, step=3).write(tmp_path / "ckpt", d.state_dict())
    config = export_checkpoint(ckpt, tmp_path / "out", TARGET)
    return d, config, tmp_path / "out"


def test_a_draft_vocab_ships_its_head_rows_and_map_as_vllm_reads_them(small_vocab):
    """vLLM 0.32's DFlashQwen3ForCausalLM sizes its lm_head by draft_vocab_size, loads the export's rows as its own
    head and scatters the draft logits onto the target vocab through d2t (target id = i + d2t[i])."""
    d, c, out = small_vocab
    assert c["draft_vocab_size"] == 32 and c["vocab_size"] == 300
    tensors = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in tensors  # still the target's
    assert tensors["lm_head.weight"].shape == (32, 64) and tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], d.d2t)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"], d.t2d)
    findings = lint_drafter(out, TARGET)
    assert not has_errors(findings), format_findings(findings)
    assert spec_from_export(out, serving=True) == d.spec
    loaded = load_drafter(out, embed_weight=d.embed_tokens.weight.detach(), serving=True)  # its own head rows
    torch.manual_seed(0)
    aux, pos = torch.randn(1, 6, 3 * 64), torch.arange(6)[None]
    want, _ = d.propose(torch.tensor([7]), torch.tensor([6]), d.context_kv(d.context(aux), pos), 3)
    got, logits = loaded.propose(torch.tensor([7]), torch.tensor([6]), loaded.context_kv(loaded.context(aux), pos), 3)
    assert logits.shape == (1, 3, 32) and torch.equal(want, got) and bool(d.t2d[got].all())  # target ids
    tensors.pop("t2d")  # vLLM skips it; a checkpoint from elsewhere may lack it: rebuilt from d2t
    save_file(tensors, out / "model.safetensors")
    assert torch.equal(load_drafter(out, embed_weight=d.embed_tokens.weight.detach(), serving=True).t2d, d.t2d)
    served = {"method": "dflash", "num_speculative_tokens": 3}
    parts, _ = dflash_layout.card(c, {"target": {"name_or_path": "t"}, "step": 3}, "me/x", served)
    assert "draft vocab: 32 of the target's 300 ids" in "\n".join(parts)


def test_lint_catches_a_broken_draft_vocab(small_vocab):
    _, _, out = small_vocab
    tensors = load_file(out / "model.safetensors")
    tensors["d2t"] = tensors["d2t"].flip(0).contiguous()  # not ascending, and t2d no longer marks its ids
    save_file(tensors, out / "model.safetensors")
    assert {"d2t-order", "t2d-mismatch"} <= _codes(out)
    del tensors["d2t"], tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors")
    assert "missing-tensor" in _codes(out)
    with pytest.raises(ValueError, match="no d2t"):
        load_drafter(out, embed_weight=torch.zeros(300, 64), head_weight=torch.zeros(300, 64), serving=True)


@pytest.mark.parametrize("change,code", [
    ({"dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 3, 4], "block_size": 4}}, "dflash-mask-token"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 4], "block_size": 4}}, "dflash-mask-token"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [2, 4, 5], "block_size": 4}}, "dflash-layer-ids"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, 8], "block_size": 4}}, "dflash-layer-ids"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, 4], "block_size": 8}}, "dflash-block-size"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}, "dflash-eagle-ids"),
    ({"use_sliding_window": True}, "dflash-causal"),
    ({"is_causal": True}, "dflash-causal"),
    ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "num-layers"),
    ({"model_type": "llama"}, "model-type"),
    ({"head_dim": None}, "head-dim"),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "architecture"),
    ({"rope_theta": 10.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}, "rope-theta"),
])
def test_lint_catches_what_serves_silently_wrong(export, change, code):
    _, _, out = export
    _edit(out, **change)
    assert code in _codes(out)


def test_lint_catches_wrong_tensors(export):
    _, _, out = export
    tensors = load_file(out / "model.safetensors")
    tensors["mask_hidden"] = torch.zeros(1, 192, dtype=torch.bfloat16)
    del tensors["layers.1.self_attn.k_norm.weight"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :128].contiguous()
    save_file(tensors, out / "model.safetensors")
    assert {"unexpected-tensor", "missing-tensor", "shape"} <= _codes(out)


def test_card_serves_it_with_vllms_dflash_method_and_cites_the_objective(export):
    from fledge.serving.card import build_model_card

    _, _, out = export
    card, _ = build_model_card(out, "org/tiny-dflash", speculative_tokens=7)
    text = str(card)
    assert '"method": "dflash", "model": "org/tiny-dflash", "num_speculative_tokens": 3' in text  # capped at block - 1
    assert "DFlashDraftModel" in text and "arXiv 2602.06036" in text and "[1, 3, 4]" in text
    assert "eagle3" not in text


def test_every_algorithm_has_its_entry_in_each_layer():
    """An algorithm is one entry per layer, under one name: its spec class and drafter (models/algorithms.py), its
    drafter and objective (train/ttt_model.py) and, unless it is EAGLE's (reserved: the dialects' path), its serving
    layout with every function serving calls (serving/layouts.py). The schema accepts exactly the specs'
    ``drafter.algorithm`` values, and each spec class is what its config values select (P-EAGLE: eagle plus
    ``parallel_drafting``), for a config as for a spec's JSON."""
    import inspect

    from fledge.conf.schema import ALGORITHMS as SCHEMA_NAMES
    from fledge.models.algorithms import ALGORITHMS, algorithm_of
    from fledge.serving.layouts import LAYOUTS, Layout
    from fledge.train.ttt_model import OBJECTIVES

    assert ALGORITHMS.names() == ["dflash", "dspark", "eagle", "mtp", "peagle"]
    assert ALGORITHMS.names() == OBJECTIVES.names() == sorted([*LAYOUTS.names(), *LAYOUTS.reserved])
    assert set(SCHEMA_NAMES) == {a.spec.algorithm for a in ALGORITHMS.values()}
    for name, algorithm in ALGORITHMS.items():
        keys = {"algorithm": algorithm.spec.algorithm, "parallel_drafting": algorithm.spec.parallel_drafting}
        assert algorithm.name == name and algorithm_of(keys) is algorithm
    with pytest.raises(ValueError, match="drafter.algorithm='dflash' with drafter.parallel_drafting=true"):
        algorithm_of({"algorithm": "dflash", "parallel_drafting": True})
    wanted = {name for name, _ in inspect.getmembers(Layout, inspect.isfunction) if not name.startswith("_")}
    assert wanted >= {"owns", "build_config", "lint", "load", "speculative_config", "card"}
    for name, layout in LAYOUTS.items():
        assert not wanted - set(dir(layout)), f"layout {name} lacks {sorted(wanted - set(dir(layout)))}"


def test_serving_reaches_a_new_algorithms_layout_through_the_registry(tmp_path):
    """A fourth algorithm's layout is found by what its export is, with no change to engine.py or lint.py."""
    from types import SimpleNamespace

    from fledge.serving.layouts import LAYOUTS

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyDrafter"]}))
    toy = SimpleNamespace(owns=lambda c: c.get("architectures") == ["ToyDrafter"],
                          speculative_config=lambda config, model, k: {"method": "toy", "model": model, "k": k},
                          lint=lambda d, config, layers, record: [("error", "toy", "toy finding", "fix it")])
    with LAYOUTS.temporary("toy", toy):
        assert speculative_config("eagle3", 3, tmp_path)["method"] == "toy"
        assert "toy" in {f.code for f in lint_drafter(tmp_path, None)}
    assert speculative_config("eagle3", 3, tmp_path)["method"] == "eagle3"
