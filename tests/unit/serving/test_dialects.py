"""Export dialects (serving/dialects.py): every registered dialect round-trips through export, lint and
load; a dialect registered in a test is picked up by all of them; export.format is checked against the
registry before a run starts."""

import json
import subprocess
import sys

import pytest
import torch

from fledge.conf.schema import DrafterConfig
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter import Eagle3Drafter
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.weights import read_tensors, tensor_headers
from fledge.serving import dialects
from fledge.serving.dialects import Dialect, ServingFields, dialect_of, get_dialect, register_dialect
from fledge.serving.export import export_checkpoint, load_drafter, write_drafter
from fledge.serving.hub import build_model_card
from fledge.serving.lint import format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import expected_tensors, layer_config, serving_config
from tests.helpers.models import random_state_dict

TARGET = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
          "vocab_size": 512, "rope_theta": 10000.0}
IDS = [2, 4, 5]


def test_registry_and_format_errors():
    assert dialects.names() == ["hf", "sglang", "speculators"]
    with pytest.raises(ValueError, match=r"export.format='gguf'.*\['hf', 'sglang', 'speculators'\].*dialects\.py"):
        get_dialect("gguf")
    with pytest.raises(ValueError, match="export.format='gguf'"):
        serving_config(TARGET, DrafterConfig(draft_vocab_size=128), IDS, 128, fmt="gguf")
    with pytest.raises(ValueError, match="already registered"):
        register_dialect(get_dialect("hf"))


@pytest.mark.parametrize("fmt", ["hf", "sglang", "speculators"])
def test_each_dialect_reads_back_what_it_builds(fmt):
    config = serving_config(TARGET, DrafterConfig(draft_vocab_size=128), IDS, 128, fmt=fmt, target_name="org/t")
    d = dialect_of(config)
    assert d.name == fmt and config["architectures"] == [d.architecture]
    c = layer_config(config)
    assert c["aux_layer_ids"] == IDS and c["draft_vocab_size"] == 128 and c["fc_norm"] and c["norm_output"]
    assert c["hidden_size"] == 64 and c["num_hidden_layers"] == 1
    layer_names = [n for n in expected_tensors(config) if "self_attn" in n or "mlp" in n]
    assert layer_names and all(n.startswith(d.layer_prefix) for n in layer_names)


def test_format_is_checked_before_a_run_starts():
    """conf cannot import the registry (it is the bottom layer); the entry point checks it first."""
    res = subprocess.run([sys.executable, "-m", "fledge", "run", "recipe=tiny", "export.format=gguf",
                          "run.output_root=/nonexistent/never-written"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "export.format='gguf'" in res.stderr and "dialects.py" in res.stderr


# ---- a registered dialect is used end to end -------------------------------------------------------

TEST_ARCH = "FledgeTestEagle3"


def _build(f: ServingFields) -> dict:
    # Another layout: the layer nested under "layer", the Eagle-3 fields under "eagle".
    return {"architectures": [TEST_ARCH], "layer": {**f.layer, **f.flags},
            "eagle": {"aux_ids": f.aux_layer_ids, "draft_vocab_size": f.draft_vocab_size, **f.flags}}


def _read(config):
    e = config.get("eagle") or {}
    out = {**config.get("layer", {}), **{k: v for k, v in e.items() if k != "aux_ids"}}
    out["aux_layer_ids"] = e.get("aux_ids")
    return out


def _checks(config):
    if "eagle" not in config:
        return [("error", "test-eagle-block", "no eagle block", "write the eagle block")]
    return []


def _commands(served, target):
    return {"TestEngine": f"serve {target} --draft {served['model']}"}


@pytest.fixture
def test_dialect():
    d = Dialect("testfmt", TEST_ARCH, "blocks.0.", _build, _read,
                detect=lambda c: TEST_ARCH in (c.get("architectures") or []), commands=_commands,
                header_checks=_checks)
    with dialects.DIALECTS.temporary("testfmt", d):
        yield d


def test_registered_dialect_exports_lints_and_loads(test_dialect, tmp_path):
    spec = DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=128), IDS)
    model = Eagle3Drafter(spec)
    model.load_state_dict(random_state_dict(serving_config(TARGET, spec, IDS, 128)))
    ckpt = DrafterCheckpoint(spec, target={"name_or_path": "org/target"}, step=2).write(tmp_path / "ckpt",
                                                                                       model.state_dict())
    out = tmp_path / "out"
    config = export_checkpoint(ckpt, out, TARGET, fmt="testfmt", max_shard_size="40KB")
    assert config["architectures"] == [TEST_ARCH] and json.loads((out / "config.json").read_text()) == config

    names = set(tensor_headers(out))
    assert "blocks.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert names == set(expected_tensors(config))

    findings = lint_drafter(out, TARGET)
    assert not has_errors(findings), format_findings(findings)
    broken = tmp_path / "broken"
    write_drafter(broken, model.state_dict(), {k: v for k, v in config.items() if k != "eagle"})
    codes = {f.code for f in lint_drafter(broken, TARGET)}
    assert "test-eagle-block" in codes and "aux-ids-missing" in codes  # its own header check, its own reader

    loaded = load_drafter(out, embed_weight=model.embed_tokens.weight.detach())
    assert loaded.spec == spec
    exported = read_tensors(out)
    for name, t in loaded.state_dict().items():
        if name != "embed_tokens.weight":
            served = exported[test_dialect.to_serving_name(name)]
            assert torch.equal(t.to(served.dtype), served), name

    card = str(build_model_card(out, "org/drafter")[0])
    assert "format: `testfmt`" in card and "serve org/target --draft org/drafter" in card


def test_model_card_commands_follow_the_dialect(tmp_path):
    trained = DrafterCheckpoint(DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=128), IDS),
                                target={"name_or_path": "org/target"})
    for fmt in ("hf", "sglang", "speculators"):
        config = serving_config(TARGET, trained.spec, IDS, 128, fmt=fmt, target_name="org/target")
        write_drafter(tmp_path / fmt, random_state_dict(config), config, trained)
        card = str(build_model_card(tmp_path / fmt, "org/drafter")[0])
        if fmt == "speculators":
            assert "vllm serve org/drafter\n" in card and "export.format=sglang" in card
        else:  # SGLang's command only where it reads the aux ids as trained (tests/unit/serving/test_engine_aux_ids.py)
            assert "vllm serve org/target --speculative-config" in card
            assert ("--speculative-algorithm EAGLE3" in card) == (fmt == "sglang")
