"""Drafter layer kinds (models/layers/): llama, qwen3 (per-head q/k norms), mla (DeepSeek latent attention).

For every kind and both flag sets: the TTT unroll equals the engine-style cached decode row by row; the
memory-linear CPU path equals the dense reference forward and backward, flex's forward equals it; the
attention equals a hand-written reference of the kind's equations (vLLM's model code, with a negative
control); the export has the names and config.json vLLM loads, lints clean, and loads back to the same
logits; the speculators dialect takes what speculators has and refuses MLA in one line.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fledge.conf.schema import DrafterConfig
from fledge.models.algorithms import DrafterSpec
from fledge.models.alignment import ttt_states
from fledge.models.drafter import DraftCache, Eagle3Drafter
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.families import TargetFamily
from fledge.models.layers.kind import check_layer_format
from fledge.models.layers.mla import MLA_DEFAULTS, mla_softmax_scale, rope_interleaved
from fledge.models.weights import tensor_headers
from fledge.serving.export import load_drafter, write_drafter
from fledge.serving.lint import has_errors, lint_drafter
from fledge.serving.serving_config import expected_tensors, serving_config
from tests.helpers.models import FLAGS, packed_batch, target_config

KINDS = ("llama", "qwen3", "mla")
ARCH = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM", "mla": "Eagle3DeepseekV2ForCausalLM"}


def drafter(kind, flags="eagle31", attention="sdpa", seed=0, target=None):
    spec = DrafterSpec.from_target_config(target or target_config(),
                                          DrafterConfig(draft_vocab_size=40, layer=kind, **FLAGS[flags]), [2, 3, 4])
    torch.manual_seed(seed)
    d = Eagle3Drafter(spec, attention=attention)
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def unroll(d, b, K):
    """[K, B, T, H] normed states of the training unroll (models/alignment.py's shift)."""
    return torch.stack(ttt_states(d, b, K))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flags", ["eagle3", "eagle31"])
def test_ttt_unroll_equals_engine_decode(kind, flags):
    """Row t at step k == prefill of its document up to t, then k cached one-token draft steps."""
    K, d, b = 3, drafter(kind, flags), packed_batch()
    with torch.no_grad():
        ttt = unroll(d, b, K)
        checked = 0
        for row, t in [(0, 3), (0, 11), (1, 7)]:
            doc = b.document_ids[row]
            start, end = int((doc == doc[t]).nonzero()[0]), int((doc == doc[t]).nonzero()[-1]) + 1
            cache, ids = DraftCache(), b.input_ids[row, start + 1: t + 2][None]
            _, g = d.decode_step(ids, d.fuse(b.aux_hidden[row, start:t + 1][None]),
                                 b.position_ids[row, start:t + 1][None], cache)
            y = d.norm(g) if flags == "eagle3" else g  # the state is y itself under norm_output
            torch.testing.assert_close(y[0, -1], ttt[0, row, t], atol=1e-5, rtol=1e-5)
            for k in range(1, K):
                if t + 1 + k >= end:
                    break
                pos = b.position_ids[row, t].view(1, 1) + k
                _, g = d.decode_step(b.input_ids[row, t + 1 + k].view(1, 1), g[:, -1:], pos, cache)
                y = d.norm(g) if flags == "eagle3" else g
                torch.testing.assert_close(y[0, -1], ttt[k, row, t], atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked >= 4


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_path_equals_dense_forward_and_backward_and_flex_forward(kind):
    K, b = 3, packed_batch()
    out, grads = {}, {}
    for impl in ("sdpa", "dense", "flex"):
        d = drafter(kind, attention=impl).train()
        if impl == "flex":  # flex has no CPU backward: its forward only
            with torch.no_grad():
                out[impl] = unroll(d, b, K)
            continue
        out[impl] = unroll(d, b, K)
        (out[impl] * torch.linspace(-1, 1, out[impl].shape[-1])).sum().backward()
        grads[impl] = {n: p.grad for n, p in d.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out["sdpa"], out["dense"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["flex"], out["dense"], atol=1e-5, rtol=1e-5)
    assert grads["sdpa"].keys() == grads["dense"].keys() and any("self_attn" in n for n in grads["sdpa"])
    for n in grads["sdpa"]:
        torch.testing.assert_close(grads["sdpa"][n], grads["dense"][n], atol=1e-4, rtol=1e-4)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_neox(x, pos, theta=10000.0):
    D = x.shape[-1]
    f = pos[:, None].float() * theta ** (-torch.arange(0, D, 2).float() / D)
    c, s = f.cos(), f.sin()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _rope_pairs(x, pos, theta=10000.0):
    D = x.shape[-1]
    f = pos[:, None].float() * theta ** (-torch.arange(0, D, 2).float() / D)
    c, s = f.cos(), f.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)


def _reference_attention(d, z, pos, interleaved=True):
    """One causal attention over z [T, 2H], written from vLLM's layer code (no Fledge module)."""
    sd, s, a = d.state_dict(), d.spec, "midlayer.self_attn."
    T = z.shape[0]
    if s.layer == "mla":
        n, nope, rope, vd = s.num_attention_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        q = _rms(z @ sd[a + "q_a_proj.weight"].T, sd[a + "q_a_layernorm.weight"]) @ sd[a + "q_b_proj.weight"].T
        q = q.view(T, n, nope + rope).transpose(0, 1)
        ckv = z @ sd[a + "kv_a_proj_with_mqa.weight"].T
        kv = (_rms(ckv[:, : s.kv_lora_rank], sd[a + "kv_a_layernorm.weight"]) @ sd[a + "kv_b_proj.weight"].T)
        kv = kv.view(T, n, nope + vd).transpose(0, 1)
        rot = _rope_pairs if interleaved else _rope_neox
        kpe = rot(ckv[:, s.kv_lora_rank:], pos).expand(n, T, rope)
        q = torch.cat([q[..., :nope], rot(q[..., nope:], pos)], -1)
        k, v = torch.cat([kv[..., :nope], kpe], -1), kv[..., nope:]
        scale = (nope + rope) ** -0.5
    else:
        hd, n, kvh = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        q = (z @ sd[a + "q_proj.weight"].T).view(T, n, hd).transpose(0, 1)
        k = (z @ sd[a + "k_proj.weight"].T).view(T, kvh, hd).transpose(0, 1)
        v = (z @ sd[a + "v_proj.weight"].T).view(T, kvh, hd).transpose(0, 1)
        if s.layer == "qwen3":
            q, k = _rms(q, sd[a + "q_norm.weight"]), _rms(k, sd[a + "k_norm.weight"])
        q, k = _rope_neox(q, pos), _rope_neox(k, pos)
        k, v = k.repeat_interleave(n // kvh, 0), v.repeat_interleave(n // kvh, 0)
        scale = hd**-0.5
    att = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return (att.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ sd[a + "o_proj.weight"].T


@pytest.mark.parametrize("kind", KINDS)
def test_attention_matches_the_kinds_equations(kind):
    d, T = drafter(kind), 7
    z, pos = torch.randn(1, T, 2 * d.spec.hidden_size), torch.arange(T)
    with torch.no_grad():
        cos, sin = d.rotary_emb(z, pos[None])
        q, k, v = d.midlayer.self_attn.project(z, cos, sin)
        mine = d.midlayer.self_attn.output(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        torch.testing.assert_close(mine[0], _reference_attention(d, z[0], pos), atol=1e-5, rtol=1e-5)
        if kind == "mla":  # negative control: neox-style RoPE on the rope dims is not vLLM's MLA
            assert (mine[0] - _reference_attention(d, z[0], pos, interleaved=False)).abs().max() > 1e-3


def test_mla_takes_the_targets_widths_and_yarn_scale():
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
    t = target_config(**yarn).to_dict()
    t.update(q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10)
    d = drafter("mla", target=t)
    s = d.spec
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim) == (None, 12, 6, 4, 10)
    assert "q_proj.weight" in "".join(d.state_dict()) and "q_a_proj" not in "".join(d.state_dict())
    m = 0.1 * math.log(32.0) + 1.0
    assert mla_softmax_scale(s) == pytest.approx(10**-0.5 * m * m)
    assert d.rotary_emb.inv_freq.numel() == 2  # RoPE spans qk_rope_head_dim only
    b = packed_batch()
    with torch.no_grad():  # v wider than q/k (padded for the attention call): still the dense reference
        torch.testing.assert_close(unroll(d, b, 2), unroll(drafter("mla", target=t, attention="dense"), b, 2),
                                   atol=1e-5, rtol=1e-5)


def test_auto_takes_the_family_kind():
    from fledge.models import families

    assert drafter("auto").spec.layer == "llama"
    fam = TargetFamily("mla_test", ("mla_test",), layer_kind="mla")
    t = {**target_config().to_dict(), "model_type": "mla_test"}
    with families.FAMILIES.temporary("mla_test", fam):
        assert drafter("auto", target=t).spec.layer == "mla"
        assert drafter("qwen3", target=t).spec.layer == "qwen3"  # an explicit kind wins
    with pytest.raises(ValueError, match=r"drafter.layer='gpt'.*models/layers/"):
        drafter("gpt")


def _export(d, tmp_path, fmt="hf"):
    cfg = serving_config(target_config(), d.spec.to_dict(), d.spec.aux_layer_ids, 40, fmt=fmt, target_name="t")
    sd = {k: v for k, v in d.state_dict().items() if k != "embed_tokens.weight"}
    out = tmp_path / f"{d.spec.layer}_{fmt}"
    write_drafter(out, sd, cfg, DrafterCheckpoint(d.spec))
    return out, cfg


@pytest.mark.parametrize("kind", KINDS)
def test_export_layout_lint_and_load_back(kind, tmp_path):
    d = drafter(kind)
    with torch.no_grad():  # the export stores bf16: round first so loading back must be exact
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    out, cfg = _export(d, tmp_path)
    assert cfg["architectures"] == [ARCH[kind]]
    assert cfg["model_type"] == {"llama": "llama", "qwen3": "qwen3", "mla": "deepseek_v2"}[kind]
    names = set(tensor_headers(out))
    assert names == set(expected_tensors(cfg))
    findings = lint_drafter(out, target_config())
    assert not has_errors(findings), findings
    ids = torch.randint(0, 50, (1, 6))
    aux = torch.randn(1, 6, 3 * 32)
    for serving in (False, True):  # the training record's spec, and config.json alone as vLLM reads it
        back = load_drafter(out, embed_weight=d.embed_tokens.weight, serving=serving).eval()
        assert back.spec.layer == kind
        with torch.no_grad():
            a = d.decode_step(ids, d.fuse(aux), torch.arange(6)[None], DraftCache())[0]
            b = back.decode_step(ids, back.fuse(aux), torch.arange(6)[None], DraftCache())[0]
        torch.testing.assert_close(a, b)


def test_lint_catches_kind_mismatches(tmp_path):
    out, cfg = _export(drafter("mla"), tmp_path)
    for change, code in [({"qk_rope_head_dim": 5}, "mla-dims"), ({"model_type": "llama"}, "model-type"),
                         ({"kv_lora_rank": 16}, "kv-lora-rank-trained")]:
        (out / "config.json").write_text(json.dumps({**cfg, **change}))
        assert code in {f.code for f in lint_drafter(out, target_config()) if f.level == "error"}, change
    warnings = {f.code for f in lint_drafter(out, target_config()) if f.level == "warning"}
    assert "mla-target" in warnings  # vLLM serves MLA drafters only beside MLA targets
    mla_target = {**target_config().to_dict(), **MLA_DEFAULTS}
    assert "mla-target" not in {f.code for f in lint_drafter(out, mla_target)}
    # a latent vLLM's MLA attention cannot cache (kv_lora_rank + qk_rope_head_dim not 320 / 512 / 576)
    assert "mla-latent" in {f.code for f in lint_drafter(out, target_config()) if f.level == "warning"}
    out, cfg = _export(drafter("qwen3"), tmp_path)
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLMEagle3"]}))
    assert {"model-type"} <= {f.code for f in lint_drafter(out, target_config()) if f.level == "error"}
    out, cfg = _export(drafter("llama"), tmp_path / "negative")
    assert not has_errors(lint_drafter(out, target_config()))  # negative control: the same checks pass


def test_speculators_dialect_per_kind(tmp_path):
    out, cfg = _export(drafter("qwen3"), tmp_path, fmt="speculators")
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert not has_errors(lint_drafter(out, target_config()))
    assert set(expected_tensors(cfg)) >= {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match="speculators has no 'mla' drafter layer.*export.format=hf"):
        _export(drafter("mla"), tmp_path, fmt="speculators")
    with pytest.raises(ValueError, match="drafter.layer=mla with export.format=speculators"):
        check_layer_format("mla", "speculators")
    check_layer_format("qwen3", "speculators")
    check_layer_format("auto", "speculators")


def test_rope_interleaved_rotates_adjacent_pairs():
    x = torch.tensor([[[[1.0, 0.0, 0.0, 1.0]]]])  # [B, H, T, D]
    f = torch.tensor([0.5, 0.25])
    cos, sin = torch.cat([f, f]).cos()[None, None], torch.cat([f, f]).sin()[None, None]
    got = rope_interleaved(x, cos, sin)[0, 0, 0]
    want = torch.tensor([math.cos(0.5), math.sin(0.5), -math.sin(0.25), math.cos(0.25)])
    torch.testing.assert_close(got, want)


def test_old_specs_without_a_layer_load_as_llama():
    d = SimpleNamespace(**drafter("llama").spec.to_dict())
    old = {k: v for k, v in vars(d).items() if k not in ("layer", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                         "qk_rope_head_dim", "v_head_dim")}
    assert DrafterSpec.from_dict(old).layer == "llama"


def test_mla_asks_vllm_for_its_cpu_mla_attention_on_cpu_only(tmp_path):
    from fledge.serving.engine import draft_options

    out, _ = _export(drafter("mla"), tmp_path)
    assert draft_options(out, "cpu") == {"attention_backend": "CPU_MLA"}
    assert draft_options(out, "cuda") == {}
    assert draft_options(_export(drafter("qwen3"), tmp_path)[0], "cpu") == {}


def test_an_mtp_module_of_an_mla_target_asks_for_cpu_mla_too(tmp_path):
    """A fine-tuned MTP export is a DeepSeek config (model_type deepseek_v3, no drafter layer kind): its attention
    is MLA, and on an AMX CPU vLLM would build it with AMX_MLA, which refuses float32 weights (CI saw that)."""
    import json

    from fledge.serving.engine import draft_options

    mtp = tmp_path / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                 "model_type": "deepseek_v3", "kv_lora_rank": 512}))
    assert draft_options(mtp, "cpu") == {"attention_backend": "CPU_MLA"}
    assert draft_options(mtp, "cuda") == {}
    (mtp / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    assert draft_options(mtp, "cpu") == {}


def test_no_layer_kind_is_special_cased_by_name_outside_its_own_file():
    """A kind's differences are fields of its LayerKind (models/layers/<kind>.py): code elsewhere that compares
    a kind or layer setting with a kind's name (``kind.name == "mla"``) would have to change with every new
    kind. The scan covers the product's rooms; the testbed's own target families share some names."""
    import ast

    from fledge.models.layers.kind import LAYER_KINDS
    from tests.helpers.paths import REPO as root

    names = set(LAYER_KINDS.names())
    offenders = []
    for room in ("fledge", "conf", "models", "data", "serving", "evaluation", "train"):
        for path in sorted((root / room).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("models/layers/"):
                continue
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                consts = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                consts += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts
                           if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if names & set(consts) and any(w in ast.get_source_segment(text, node) for w in ("kind", "layer")):
                    offenders.append(f"{rel}:{node.lineno}: {ast.get_source_segment(text, node)}")
    assert not offenders, offenders
