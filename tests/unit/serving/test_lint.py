"""Linter: a good export passes; each planted silent failure (docs/serving.md, Silent failures) is caught with its
fix."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.serving.export import write_drafter
from fledge.serving.lint import format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import serving_config
from tests.helpers.models import random_state_dict

TARGET = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "vocab_size": 512, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 1024},
}


def _spec():
    """The DrafterSpec dict training records for a drafter of TARGET (every layer field the record holds)."""
    from fledge.conf.schema import DrafterConfig
    from fledge.models.algorithms import DrafterSpec

    return DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=128), [2, 4, 5]).to_dict()


SPEC = _spec()
TRAINED = DrafterCheckpoint(DrafterSpec.from_dict(SPEC))  # what the exports here record
assert SPEC["rope"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("lint") / "good"
    config = serving_config(TARGET, SPEC, SPEC["aux_layer_ids"], 128)
    write_drafter(out, random_state_dict(config), config, TRAINED.at_step(1))
    return out


def _codes(path, target=TARGET):
    return {f.code for f in lint_drafter(path, target) if f.level == "error"}


def test_good_export_passes(good):
    findings = lint_drafter(good, TARGET)
    assert not has_errors(findings), format_findings(findings)


def _edit_config(d, fn):
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def _edit_tensors(d, fn):
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def _edit_record(d, fn):
    r = json.loads((d / RECORD).read_text())
    fn(r)
    (d / RECORD).write_text(json.dumps(r))


def _swap_d2t(t):
    d2t = t["d2t"].clone()
    d2t[[3, 4]] = d2t[[4, 3]] + torch.tensor([1, -1])  # ids i + d2t[i] swapped: no longer ascending
    t["d2t"] = d2t


FAULTS = {
    # aux-id convention and range
    "aux-ids-start-1": lambda d: _edit_config(d, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[1, 4, 5])),
    "aux-ids-range": lambda d: _edit_config(d, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 4, 8])),
    "aux-ids-trained": lambda d: _edit_config(d, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 4, 6])),
    "aux-ids-missing": lambda d: _edit_config(d, lambda c: c.pop("eagle_config")),
    "aux-ids-order": lambda d: _edit_config(d, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[4, 2, 5])),
    # RoPE / max positions not copied from the target
    "max-positions": lambda d: _edit_config(d, lambda c: c.update(max_position_embeddings=2048)),
    "rope-scaling": lambda d: _edit_config(d, lambda c: c.update(rope_scaling=None, rope_parameters=None)),
    "rope-theta": lambda d: _edit_config(d, lambda c: c.update(rope_theta=10000.0, rope_parameters=None)),
    "rms-eps": lambda d: _edit_config(d, lambda c: c.update(rms_norm_eps=1e-6)),
    # norm flags vs training
    "norm-output-mismatch": lambda d: _edit_config(d, lambda c: c.update(norm_output=False)),
    "fc-norm-flag": lambda d: _edit_config(d, lambda c: c.update(fc_norm=False)),
    "fc-norm-and-norm-before-fc": lambda d: _edit_config(d, lambda c: c.update(norm_before_fc=True)),
    # vocab sizes
    "vocab-size": lambda d: _edit_config(d, lambda c: c.update(vocab_size=500)),
    "shape": lambda d: _edit_config(d, lambda c: c.update(draft_vocab_size=100)),
    # d2t / t2d consistency
    "d2t-order": lambda d: _edit_tensors(d, _swap_d2t),
    "d2t-range": lambda d: _edit_tensors(d, lambda t: t.update(d2t=t["d2t"] + 1000)),
    "t2d-mismatch": lambda d: _edit_tensors(d, lambda t: t.update(t2d=torch.roll(t["t2d"], 1))),
    # dtype, names
    "dtype": lambda d: _edit_tensors(d, lambda t: t.update(d2t=t["d2t"].to(torch.int32))),
    "missing-tensor": lambda d: _edit_tensors(d, lambda t: t.pop("midlayer.hidden_norm.weight")),
    "unexpected-tensor": lambda d: _edit_tensors(d, lambda t: t.update(
        {"midlayer.self_attn.q_norm.weight": torch.ones(16, dtype=torch.bfloat16)})),
    "architecture": lambda d: _edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLM"])),
}


@pytest.mark.parametrize("code", sorted(FAULTS))
def test_each_planted_fault_is_caught(good, tmp_path, code):
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(good, bad)
    FAULTS[code](bad)
    findings = lint_drafter(bad, TARGET)
    assert code in {f.code for f in findings if f.level == "error"}, format_findings(findings)
    assert all(f.fix for f in findings)


def test_training_record_catches_flag_drift_without_target(good, tmp_path):
    """Trained with pre-norm feedback (EAGLE-3) while config.json says norm_output=true: only the record
    can tell, and the linter needs no target config for it."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    _edit_record(bad, lambda r: r["trained_with"].update(norm_output=False))
    assert "norm-output-mismatch" in _codes(bad, target=None)
    _edit_record(bad, lambda r: r.pop("trained_with"))
    warn = {f.code for f in lint_drafter(bad, None)}
    assert "no-training-record" in warn


# Each layer setting an engine reads from config.json, planted wrong: only the training record can tell.
TRAINED_FIELDS = {"rms_norm_eps": 1e-6, "hidden_act": "gelu", "hidden_size": 48, "intermediate_size": 96,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 500,
                  "draft_vocab_size": 100, "target_hidden_size": 32}


@pytest.mark.parametrize("key", sorted(TRAINED_FIELDS))
def test_every_served_layer_field_is_checked_against_training(good, tmp_path, key):
    """A wrong rms_norm_eps or hidden_act (or any layer field) in config.json loads and serves silently: an
    error from the training record alone (no target config), for both dialects."""
    import shutil

    for fmt, bad in (("hf", tmp_path / "hf"), ("speculators", tmp_path / "spec")):
        if fmt == "hf":
            shutil.copytree(good, bad)
            _edit_config(bad, lambda c: c.update({key: TRAINED_FIELDS[key]}))
        else:
            config = serving_config(TARGET, SPEC, SPEC["aux_layer_ids"], 128, fmt=fmt, target_name="t")
            write_drafter(bad, random_state_dict(config), config, TRAINED)
            where = "transformer_layer_config" if key not in ("draft_vocab_size", "target_hidden_size") else None
            _edit_config(bad, lambda c, where=where, key=key: (c[where] if where else c).update(
                {key: TRAINED_FIELDS[key]}))
        code = f"{key.replace('_', '-')}-trained"
        assert code in _codes(bad, target=None), (fmt, format_findings(lint_drafter(bad, None)))
    assert not {f.code for f in lint_drafter(good, None) if f.code.endswith("-trained")}


def test_speculators_export_and_norm_before_residual(tmp_path):
    config = serving_config(TARGET, SPEC, SPEC["aux_layer_ids"], 128, fmt="speculators", target_name="t")
    out = write_drafter(tmp_path / "spec", random_state_dict(config), config, TRAINED)
    assert not has_errors(lint_drafter(out, TARGET)), format_findings(lint_drafter(out, TARGET))
    _edit_config(out, lambda c: c.pop("norm_before_residual"))
    assert "norm-before-residual" in _codes(out)


def test_cli_exit_status(good, tmp_path):
    import shutil

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    cmd = [sys.executable, "-m", "fledge", "lint"]
    ok = subprocess.run(cmd + [str(good), "--target", str(tmp_path / "target")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    FAULTS["max-positions"](bad)
    res = subprocess.run(cmd + [str(bad), "--target", str(tmp_path / "target")], capture_output=True, text=True)
    assert res.returncode == 1 and "max-positions" in res.stdout
    assert "fix: set max_position_embeddings=4096" in res.stdout
