"""FrozenTarget: hook-captured states equal output_hidden_states at the boundary ids; padding invariance;
loading from safetensors matches the tensors read without the model (tied and untied); config mismatch
refused. Reading single tensors is tested in test_weights.py."""

import pytest
import torch

from fledge.conf.schema import TargetConfig
from fledge.models.target import FrozenTarget, check_target_config
from fledge.models.weights import load_input_embeddings, load_lm_head_rows

L, H, V = 4, 64, 160


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=V, max_position_embeddings=128))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=128,
                                        tie_word_embeddings=True))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return (_llama if request.param == "llama" else _qwen3)().eval()


@pytest.mark.parametrize("ids", [[0, 2, 3], [3, 1]])
def test_capture_matches_output_hidden_states(model, ids):
    target = FrozenTarget(model, ids)
    x = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    aux, final, argmax = target.capture(x)
    with torch.no_grad():
        ref = model(x, output_hidden_states=True)
    hs = ref.hidden_states
    assert len(hs) == L + 1
    torch.testing.assert_close(aux, torch.cat([hs[k] for k in ids], dim=-1), rtol=0, atol=0)
    # the final normed state is what feeds lm_head: it reproduces the logits, and argmax follows
    torch.testing.assert_close(target.lm_head(final), ref.logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, ref.logits.argmax(-1))
    # ids differ -> the captured blocks differ (the hooks are not all reading the same tensor)
    assert not torch.equal(aux[..., :H], aux[..., H:2 * H])


def test_padding_does_not_change_real_tokens(model):
    target = FrozenTarget(model, [1, 3])
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, V, (13,), generator=g), torch.randint(1, V, (6,), generator=g)
    ids = torch.zeros(2, 13, dtype=torch.long)
    ids[0], ids[1, :6] = a, b
    mask = torch.zeros(2, 13, dtype=torch.long)
    mask[0], mask[1, :6] = 1, 1
    aux, final, argmax = target.capture(ids, attention_mask=mask)
    for row, seq in ((0, a), (1, b)):
        a1, f1, m1 = target.capture(seq[None])
        n = len(seq)
        torch.testing.assert_close(aux[row, :n], a1[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[row, :n], f1[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(argmax[row, :n], m1[0])
    assert (argmax[1, 6:] == 0).all()


def test_argmax_chunking(model, monkeypatch):
    import fledge.models.target as mt

    target = FrozenTarget(model, [1])
    x = torch.randint(0, V, (1, 17), generator=torch.Generator().manual_seed(4))
    full = target.capture(x)[2]
    monkeypatch.setattr(mt, "LOGITS_CHUNK_BYTES", 4 * V * 3)  # 3 rows per chunk
    assert torch.equal(target.capture(x)[2], full)


@pytest.mark.parametrize("kind,shard", [("llama", "40KB"), ("qwen3", None)])
def test_tensors_from_safetensors(tmp_path, kind, shard):
    model = _llama() if kind == "llama" else _qwen3()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    sel = torch.tensor([0, 5, 17, V - 1])
    rows = load_lm_head_rows(str(tmp_path), None, sel)
    torch.testing.assert_close(rows, model.lm_head.weight.detach()[sel], rtol=0, atol=0)
    emb = load_input_embeddings(str(tmp_path))
    torch.testing.assert_close(emb, model.get_input_embeddings().weight.detach(), rtol=0, atol=0)
    tied = kind == "qwen3"
    assert torch.equal(rows, emb[sel]) == tied  # random init: untied heads differ from the embedding
    tcfg = TargetConfig(name_or_path=str(tmp_path), dtype="float32", num_hidden_layers=L, hidden_size=H, vocab_size=V)
    target = FrozenTarget.load(tcfg, torch.device("cpu"), [1, 2])
    assert not any(p.requires_grad for p in target.model.parameters()) and not target.model.training
    torch.testing.assert_close(target.lm_head.weight.detach()[sel], rows, rtol=0, atol=0)
    torch.testing.assert_close(target.input_embeddings(), emb, rtol=0, atol=0)


def test_config_mismatch_names_key(model):
    tcfg = TargetConfig(name_or_path="x", num_hidden_layers=L, hidden_size=H + 1, vocab_size=V)
    with pytest.raises(ValueError, match="target.hidden_size"):
        check_target_config(model.config, tcfg)
    check_target_config(model.config, TargetConfig(name_or_path="x", num_hidden_layers=L, hidden_size=H, vocab_size=V))
