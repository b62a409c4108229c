"""Weights I/O (models/weights.py): the one reader of safetensors indexes. Containment of index entries,
headers without data, only the needed shards opened, and the target's own final norm / embedding / lm_head
chosen over a vision tower's, a projector's or an MTP module's, on the tensor names of real targets
(tests/fixtures/tensor_names/, written by scripts/tensor_name_fixtures.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from fledge.models.weights import (
    INDEX,
    load_input_embeddings,
    load_lm_head_rows,
    read_tensors,
    tensor_headers,
    weight_map,
)
from fledge.serving.export import load_drafter, write_drafter
from fledge.serving.lint import lint_drafter
from fledge.serving.serving_config import serving_config
from tests.helpers.models import random_state_dict
from tests.helpers.paths import FIXTURES


def _sharded(tmp_path, tensors_by_shard: dict[str, dict[str, torch.Tensor]]):
    wm = {}
    for shard, tensors in tensors_by_shard.items():
        save_file(tensors, str(tmp_path / shard))
        wm.update({name: shard for name in tensors})
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tmp_path


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/outside.safetensors", "sub/../../x.safetensors",
                                   "C:\\x.safetensors", "..\\x.safetensors", ""])
def test_index_pointing_outside_its_directory_is_refused(tmp_path, entry):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"a": torch.zeros(2)}, str(d / "model-00001.safetensors"))
    (tmp_path / "outside.safetensors").write_bytes((d / "model-00001.safetensors").read_bytes())
    (d / INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors", "b": entry}}))
    for read in (weight_map, tensor_headers, read_tensors, load_input_embeddings):
        with pytest.raises(ValueError, match=rf"{INDEX}: weight_map entry .* points outside") as e:
            read(d)
        assert str(d / INDEX) in str(e.value)


def test_lint_and_load_refuse_an_export_with_a_bad_index(tmp_path):
    target = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "vocab_size": 256}
    spec = {"fc_norm": True, "norm_output": True, "aux_layer_ids": [2, 3, 4], "draft_vocab_size": 64}
    config = serving_config(target, spec, [2, 3, 4], 64)
    d = write_drafter(tmp_path / "drafter", random_state_dict(config), config, max_shard_size="20KB")
    index = json.loads((d / INDEX).read_text())
    index["weight_map"]["fc.weight"] = "../elsewhere.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    found = {f.code: f.message for f in lint_drafter(d, target)}
    assert "points outside" in found["no-weights"]
    with pytest.raises(ValueError, match="points outside"):
        load_drafter(d, embed_weight=torch.zeros(256, 32))


def test_headers_and_named_reads_open_only_what_they_need(tmp_path):
    x = torch.arange(6.).view(2, 3)
    d = _sharded(tmp_path, {"a.safetensors": {"x": x, "y": torch.ones(4, dtype=torch.bfloat16)},
                            "b.safetensors": {"z": torch.tensor([1, 2], dtype=torch.int64)}})
    assert weight_map(d) == {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    assert tensor_headers(d) == {"x": ((2, 3), "F32"), "y": ((4,), "BF16"), "z": ((2,), "I64")}
    (d / "b.safetensors").write_bytes(b"not a safetensors file")  # never opened for x
    assert torch.equal(read_tensors(d, ["x"])["x"], x)
    (d / "b.safetensors").unlink()
    with pytest.raises(ValueError, match="names b.safetensors, which is missing"):
        read_tensors(d, ["z"])
    with pytest.raises(ValueError, match=r"tensors \['w'\] are not in"):
        read_tensors(d, ["w"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors and no model.safetensors.index.json"):
        weight_map(tmp_path / "empty")


def test_mtp_copies_are_never_the_targets_embedding_or_head(tmp_path):
    """DeepSeek-V3 stores its MTP module as layer L (model.layers.61.*) with its own embedding and head
    copies; Fledge must take the main model's (a shorter-name rule alone would be an accident)."""
    emb, head = torch.randn(16, 4), torch.randn(16, 4)
    d = _sharded(tmp_path, {
        "a.safetensors": {"model.layers.1.embed_tokens.weight": torch.randn(16, 4),  # MTP layer (L = 1 here)
                          "model.layers.1.shared_head.head.weight": torch.randn(16, 4),
                          "model.layers.1.lm_head.weight": torch.randn(16, 4)},
        "b.safetensors": {"model.embed_tokens.weight": emb, "lm_head.weight": head}})
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False, "num_nextn_predict_layers": 1}))
    assert torch.equal(load_input_embeddings(d), emb)
    sel = torch.tensor([0, 3, 15])
    assert torch.equal(load_lm_head_rows(d, None, sel), head[sel])
    # tied (here through a multimodal config's text part): the embedding's rows
    (d / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert torch.equal(load_lm_head_rows(d, None, sel), emb[sel])


def test_lm_head_rows_are_read_in_blocks_in_any_order(tmp_path, monkeypatch):
    import fledge.models.weights as weights

    W = torch.randn(1000, 16).to(torch.bfloat16)
    save_file({"lm_head.weight": W, "model.embed_tokens.weight": -W}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    reads = []
    real_open = weights.__dict__.get("safe_open")
    from safetensors import safe_open as st_open

    def counting_open(*a, **k):
        reads.append(a[0])
        return st_open(*a, **k)

    monkeypatch.setattr("safetensors.safe_open", counting_open)
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 16 * 2 * 100)  # 100 rows a block
    assert torch.equal(load_lm_head_rows(tmp_path, None, torch.tensor([7, 3])), W[[7, 3]])
    one_block = len(reads)
    reads.clear()
    ids = torch.tensor([999, 0, 5, 150, 151, 640])
    assert torch.equal(load_lm_head_rows(tmp_path, None, ids), W[ids])
    assert len(reads) == one_block + 3  # only the blocks holding a wanted row are read (0, 1, 6, 9 of 10)
    assert torch.equal(load_lm_head_rows(tmp_path, None, torch.arange(1000)), W)
    with pytest.raises(ValueError, match=r"outside \[0, 1000\)"):
        load_lm_head_rows(tmp_path, None, torch.tensor([1000]))
    assert real_open is None  # safetensors is imported where it is used, so the patch above is what ran


# ---- which tensors are the target's final norm, input embedding and lm_head, on real layouts ---------------

TENSOR_NAMES = FIXTURES / "tensor_names"  # written by scripts/tensor_name_fixtures.py
# fixture (tests/fixtures/tensor_names/<name>.json) -> (final norm, input embedding, lm_head)
PICKS = {
    # a VLM wrapper: the vision projector's pre_norm has a shorter name than the decoder's norm
    "kimi_k2_6": ("language_model.model.norm.weight", "language_model.model.embed_tokens.weight",
                  "language_model.lm_head.weight"),
    # the MTP module as layer 61, with its own embed_tokens, shared_head.norm/head, enorm and hnorm
    "deepseek_v3": ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"),
    # the decoder nested under model.language_model, beside model.visual's merger norms
    "qwen3_vl_8b": ("model.language_model.norm.weight", "model.language_model.embed_tokens.weight", "lm_head.weight"),
    "llama3_1_8b": ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"),
}


def _fixture_names(name: str) -> dict[str, str]:
    fixture = json.loads((TENSOR_NAMES / f"{name}.json").read_text())
    return {n: "model-00001.safetensors" for n in fixture["names"]}  # a weight_map: names -> shard


@pytest.mark.parametrize("name", sorted(PICKS))
def test_final_norm_embedding_and_head_are_the_decoder_stacks_own(name):
    from fledge.models.weights import final_norm_name, input_embedding_name, lm_head_name

    names = _fixture_names(name)
    norm, embed, head = PICKS[name]
    assert (final_norm_name(names), input_embedding_name(names), lm_head_name(names)) == (norm, embed, head)
    # whatever order the index lists them in
    reordered = dict(reversed(list(names.items())))
    assert (final_norm_name(reordered), input_embedding_name(reordered), lm_head_name(reordered)) == (norm, embed, head)


def test_a_tied_target_has_no_head_and_an_ambiguous_layout_is_refused():
    from fledge.models.weights import final_norm_name, input_embedding_name, lm_head_name

    tied = {n: s for n, s in _fixture_names("llama3_1_8b").items() if n != "lm_head.weight"}
    assert lm_head_name(tied) is None and final_norm_name(tied) == "model.norm.weight"
    two = {**tied, **{n.replace("model.", "other.", 1): s for n, s in tied.items()}}  # two decoders with embeddings
    with pytest.raises(ValueError, match=r"two or more decoder stacks.*model\..*other\."):
        input_embedding_name(two)


def test_engine_capture_head_takes_the_decoder_norm_of_a_vlm_target(tmp_path):
    """A VLM whose projector norm has the hidden width: picking it would make a wrong teacher silently."""
    from fledge.data.capture.engine import TargetHead

    V, H = 16, 8
    save_file({"language_model.model.embed_tokens.weight": torch.randn(V, H),
               "language_model.model.layers.0.input_layernorm.weight": torch.ones(H),
               "language_model.model.norm.weight": torch.full((H,), 2.0),
               "language_model.lm_head.weight": torch.randn(V, H),
               "mm_projector.pre_norm.weight": torch.full((H,), 3.0),
               "vision_tower.encoder.final_layernorm.weight": torch.full((H,), 4.0)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    head = TargetHead.load(str(tmp_path), None, 1e-6, "cpu", torch.float32)
    assert torch.equal(head.norm_weight, torch.full((H,), 2.0))
