"""The MTP drafter's serving layout (serving/mtp_layout.py): the export vLLM's method mtp loads (the target's config,
the module's tensors under model.layers.L, the target's tables left out), read back as trained and as served, the lint
of its silent failures, and the deepseek_v3 recipe's MTP fine-tune at full size (a sparse export: real headers, holes
for bytes)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.mtp_drafter import MtpSpec
from fledge.models.weights import load_input_embeddings, load_lm_head_rows, tensor_headers
from fledge.serving import mtp_layout
from fledge.serving.export import export_checkpoint, load_drafter, spec_from_export
from fledge.serving.lint import compose_recipe, format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import serving_config, vllm_speculative_config
from tests.helpers.mtp import random_mtp_drafter, save_random_mtp_target, target_config
from tests.helpers.paths import REPO

L, V = 4, 2560


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_random_mtp_target(tmp_path_factory.mktemp("mtp_target"), layers=L)


def _export(target: Path, out: Path, norm_output: bool = True) -> Path:
    drafter = random_mtp_drafter(target, norm_output=norm_output)
    drafter.load_target(load_input_embeddings(target), load_lm_head_rows(target, None, torch.arange(V)))
    ckpt = DrafterCheckpoint(drafter.spec, step=3, target={"name_or_path": str(target)})
    ckpt = ckpt.write(out / "ckpt", drafter.state_dict())
    export_checkpoint(ckpt, out / "export", target_config(target))
    return out / "export"


@pytest.fixture(scope="module")
def export(target, tmp_path_factory):
    return _export(target, tmp_path_factory.mktemp("mtp_export"))


def test_the_export_is_the_targets_mtp_layer(target, export):
    config = json.loads((export / "config.json").read_text())
    want = {k: v for k, v in target_config(target).items() if k not in ("transformers_version", "dtype")}
    assert {k: config[k] for k in want} == {**want, "num_nextn_predict_layers": 1}
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and mtp_layout.owns(config)
    headers = tensor_headers(export)
    assert {n: tuple(s) for n, (s, _) in headers.items()} == mtp_layout.expected_tensors(config)
    assert all(n.startswith(f"model.layers.{L}.") for n in headers) and {d for _, d in headers.values()} == {"BF16"}
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in headers)  # vLLM shares the target's
    findings = lint_drafter(export, target_config(target))
    assert not [f for f in findings if f.level != "note"], format_findings(findings)
    assert vllm_speculative_config(config, str(export), 3) == {"method": "mtp", "model": str(export),
                                                               "num_speculative_tokens": 3}


def test_the_export_reads_back_as_trained_and_as_served(target, export, tmp_path):
    trained = DrafterCheckpoint.read(export.parent / "ckpt")
    assert spec_from_export(export) == trained.spec
    served = spec_from_export(export, serving=True)
    assert isinstance(served, MtpSpec) and served.norm_output and served.aux_layer_ids == [L]
    loaded = load_drafter(export, target=target, serving=True)
    state = DrafterCheckpoint.tensors(export.parent / "ckpt")
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name].bfloat16().float() if "shared_head.head" not in name and "embed" not in
                           name else state[name]), name
    untouched = load_drafter(target, target=target, serving=True)  # the target's own directory: its own module
    assert isinstance(untouched.spec, MtpSpec)
    assert not has_errors(lint_drafter(target, target_config(target)))


def _mutated(export: Path, out: Path, config=None, tensors=None, record=None) -> Path:
    d = out / "mutated"
    shutil.copytree(export, d)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config(json.loads((d / "config.json").read_text()))))
    if tensors is not None:
        save_file(tensors(load_file(d / "model.safetensors")), d / "model.safetensors", metadata={"format": "pt"})
    if record is not None:
        path = d / "fledge_training.json"
        path.write_text(json.dumps(record(json.loads(path.read_text()))))
    return d


def _renamed(t: dict, old: str, new: str) -> dict:
    return {n.replace(old, new): v for n, v in t.items()}


@pytest.mark.parametrize("change,code", [
    (dict(config=lambda c: {**c, "num_nextn_predict_layers": 0}), "mtp-layers"),
    (dict(config=lambda c: {**c, "num_hidden_layers": L + 1}), "mtp-layer-index"),
    (dict(tensors=lambda t: _renamed(t, f"model.layers.{L}.", f"model.layers.{L - 1}.")), "mtp-layer-index"),
    (dict(tensors=lambda t: {n: v for n, v in t.items() if ".enorm." not in n}), "missing-tensor"),
    (dict(tensors=lambda t: {n: v for n, v in t.items() if ".hnorm." not in n}), "missing-tensor"),
    (dict(tensors=lambda t: {n: v for n, v in t.items() if ".eh_proj." not in n}), "missing-tensor"),
    (dict(tensors=lambda t: {**t, f"model.layers.{L}.extra.weight": torch.zeros(2)}), "unexpected-tensor"),
    (dict(config=lambda c: {**c, "quantization_config": {"quant_method": "fp8"}}), "mtp-quantized"),
    (dict(config=lambda c: {**c, "moe_intermediate_size": 32}), "mtp-config-trained"),
    (dict(record=lambda r: {**r, "spec": {**r["spec"], "norm_output": False}}), "mtp-feedback"),
])
def test_the_lint_catches_each_silent_failure(export, tmp_path, target, change, code):
    findings = lint_drafter(_mutated(export, tmp_path, **change), target_config(target))
    assert code in {f.code for f in findings if f.level == "error"}, format_findings(findings)


def test_a_module_trained_with_pre_norm_feedback_is_refused_for_vllm(target, tmp_path):
    """Trained feeding out back (norm_output=false): vLLM 0.32 feeds shared_head.norm(out), so the lint refuses it
    and the harness measures it as served (post-norm)."""
    export = _export(target, tmp_path, norm_output=False)
    assert "mtp-feedback" in {f.code for f in lint_drafter(export, target_config(target)) if f.level == "error"}
    assert not spec_from_export(export).norm_output and spec_from_export(export, serving=True).norm_output


def _sparse(out: Path, config: dict, shapes: dict[str, tuple[int, ...]]) -> Path:
    """config.json + a model.safetensors of bf16 holes with real headers (the linter reads headers only)."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in sorted(shapes.items()):
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return out


def test_deepseek_v3_recipe_mtp_fine_tune_composes_and_lints_at_full_size(tmp_path):
    """recipe=deepseek_v3 drafter=mtp: DeepSeek-V3's own MTP layer (model.layers.61, 256 routed experts) exported
    from the published config lints clean against it; the same export against another layer count does not."""
    cfg = compose_recipe("deepseek_v3", ["drafter=mtp"])
    snap = {k: v for k, v in json.loads((REPO / "recipes/deepseek_v3/target_config.json").read_text()).items()
            if not k.startswith("_")}
    assert cfg.drafter.algorithm == "mtp" and cfg.drafter.norm_output and not cfg.drafter.fc_norm
    spec = MtpSpec.from_target_config(cfg.target.config_overrides, cfg.drafter)
    config = serving_config(cfg.target.config_overrides, spec, spec.aux_layer_ids, spec.draft_vocab_size)
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
    shapes = mtp_layout.expected_tensors(config)
    assert "model.layers.61.mlp.experts.255.down_proj.weight" in shapes and len(shapes) > 256 * 3
    d = _sparse(tmp_path / "drafter", config, shapes)
    findings = lint_drafter(d, snap)
    assert not has_errors(findings), format_findings(findings)
    assert has_errors(lint_drafter(d, {**snap, "num_hidden_layers": 60}))
    assert (d / "model.safetensors").stat().st_blocks * 512 < 16 << 20  # sparse: the ~11B parameters take no disk
