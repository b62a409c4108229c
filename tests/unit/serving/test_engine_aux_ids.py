"""Which target layers vLLM and SGLang capture for an export's aux ids, checked against each engine's capture
rule written here as code from its source (SGLang cannot run in CI): the SGLang command is printed only for
an export SGLang reads as trained, lint knows each engine's reading, and the sglang export form (no explicit
ids) is refused for ids only an explicit list could carry."""

import json

import pytest
import torch

from fledge.conf.schema import DrafterConfig, default_aux_layer_ids
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.serving import dialects
from fledge.serving.dialects import get_dialect
from fledge.serving.export import load_drafter, spec_from_export, write_drafter
from fledge.serving.hub import build_model_card
from fledge.serving.lint import format_findings, has_errors, lint_drafter
from fledge.serving.serving_config import layer_config, serving_config, vllm_speculative_config
from tests.helpers.models import random_state_dict


def sglang_captures(config: dict, num_layers: int) -> list[int] | None:
    """The boundary ids (hidden_states[k] of a transformers forward) SGLang feeds a drafter of ``config``,
    None when SGLang does not serve it.

    From SGLang's source (github.com/sgl-project/sglang, python/sglang/srt/):
    - the draft model class is looked up by ``architectures`` (srt/models/llama_eagle3.py registers
      ``LlamaForCausalLMEagle3``, srt/models/deepseek_eagle3.py ``Eagle3DeepseekV2ForCausalLM``); there is no
      ``Eagle3Speculator``, the speculators format's.
    - model_executor/model_runner.py, ModelRunner.__init__: ``eagle_config = getattr(draft_model_config.hf_config,
      "eagle_config", None)``; ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` inside a bare ``try``, None on
      any failure (no eagle_config, no key). A top-level key is not read.
    - srt/models/llama.py, LlamaForCausalLM.set_eagle3_layers_to_capture: None -> ``layers_to_capture = [2,
      num_layers // 2, num_layers - 3]``; else ``[val + 1 for val in layer_ids]`` ("for the ith layer, it takes
      the output of the (i-1)th layer as aux hidden state").
    - srt/models/llama.py, LlamaModel.forward: ``for i in range(start_layer, end_layer): if i in layers_to_capture:
      aux_hidden_states.append(hidden_states + residual)`` before ``self.layers[i]`` runs: the residual stream
      after i layers (boundary id i), in layer order, each layer once; an id of L or more is never reached.
    """
    if "Eagle3Speculator" in (config.get("architectures") or []):
        return None
    try:
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    to_capture = [2, num_layers // 2, num_layers - 3] if ids is None else [v + 1 for v in ids]
    return [i for i in range(num_layers) if i in to_capture]


def vllm_captures(config: dict, num_layers: int) -> list[int]:
    """The boundary ids vLLM 0.32 feeds a drafter of ``config`` (its source: .engine/venv/.../vllm/):
    v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``: the top-level
    ``eagle_aux_hidden_state_layer_ids``, if empty ``eagle_config``'s; none -> the model's
    ``get_eagle3_default_aux_hidden_state_layers`` (model_executor/models/interfaces.py): (2, L//2, L-3).
    ``_set_aux_hidden_state_layers`` sorts and de-duplicates; model_executor/models/llama.py ``LlamaModel.forward``
    records id ``start_layer`` before the first layer and ``idx + 1`` after layer ``idx`` (boundary ids)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (2, num_layers // 2, num_layers - 3)
    return [k for k in range(num_layers + 1) if k in ids]


def _target(L: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "vocab_size": 512, "rope_theta": 10000.0}


def _spec(L: int, ids: list[int]) -> dict:
    return DrafterSpec.from_target_config(_target(L), DrafterConfig(draft_vocab_size=128), ids).to_dict()


def _export(tmp_path, fmt: str, L: int, ids: list[int]):
    spec = _spec(L, ids)
    config = serving_config(_target(L), spec, ids, 128, fmt=fmt, target_name="org/target")
    trained = DrafterCheckpoint(DrafterSpec.from_dict(spec))
    return write_drafter(tmp_path / f"{fmt}-{L}", random_state_dict(config), config, trained), config


def test_sglang_reads_the_hf_exports_ids_one_layer_deeper():
    """The state dump of the issue: a config holding [2, 4, 5] made SGLang capture hidden_states[3], [5], [6]."""
    config = serving_config(_target(8), _spec(8, [2, 4, 5]), [2, 4, 5], 128)
    assert sglang_captures(config, 8) == [3, 5, 6] and vllm_captures(config, 8) == [2, 4, 5]


def test_fledges_engine_rules_are_the_engines_rules():
    from fledge.serving.engine_aux import captured_layers

    configs = [{}, {"eagle_config": {"use_aux_hidden_state": True}},
               {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}},
               {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 2, 2]}},
               {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}},  # 7 + 1 = L: never reached
               {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]},  # top level (speculators): vLLM only
               {"eagle_aux_hidden_state_layer_ids": [2, 3, 4],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}},
               {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}]
    for config in configs:
        for L in (8, 32, 61):
            assert captured_layers("SGLang", config, L) == sglang_captures(config, L), (config, L)
            assert captured_layers("vLLM", config, L) == vllm_captures(config, L), (config, L)


@pytest.mark.parametrize("L", [8, 32, 61])
def test_the_sglang_command_is_printed_only_for_an_export_sglang_reads_as_trained(tmp_path, L):
    ids = default_aux_layer_ids(L)
    printed = {}
    for fmt in dialects.names():
        d, config = _export(tmp_path, fmt, L, ids)
        commands = get_dialect(fmt).commands(vllm_speculative_config(config, "org/drafter", 5), "org/target")
        printed[fmt] = any("sglang.launch_server" in cmd for cmd in commands.values())
        assert printed[fmt] == (sglang_captures(config, L) == ids), (fmt, sglang_captures(config, L), commands)
        assert ("sglang.launch_server" in str(build_model_card(d, "org/drafter")[0])) == printed[fmt]
        if any("vllm serve" in cmd for cmd in commands.values()):  # and every vLLM command reads it as trained
            assert vllm_captures(config, L) == ids, fmt
    assert not printed["hf"] and printed.get("sglang")  # the gate is not vacuous: one form has the command


def test_the_sglang_form_is_read_back_by_fledge_as_trained(tmp_path):
    d, config = _export(tmp_path, "sglang", 32, [2, 16, 29])
    assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"] and config["target_num_hidden_layers"] == 32
    assert layer_config(config)["aux_layer_ids"] == [2, 16, 29]
    assert spec_from_export(d, serving=True).aux_layer_ids == [2, 16, 29]  # as the engines build it, no target given
    served = load_drafter(d, embed_weight=torch.zeros(512, 64), serving=True)
    assert served.spec.aux_layer_ids == [2, 16, 29] and served.spec.target_num_hidden_layers == 32
    findings = lint_drafter(d, _target(32))
    assert not has_errors(findings), format_findings(findings)
    assert not [f for f in findings if f.code.startswith("aux-ids")], format_findings(findings)


def test_the_sglang_form_is_refused_for_ids_sglang_cannot_read(tmp_path):
    from fledge.serving.dialects import check_export_format

    with pytest.raises(ValueError,
                       match=r"export.format=sglang with aux layer ids \[2, 3, 4\]: SGLang adds 1.*\[2, 4, 5\]"):
        serving_config(_target(8), _spec(8, [2, 3, 4]), [2, 3, 4], 128, fmt="sglang")
    with pytest.raises(ValueError, match=r"export.format=sglang with aux layer ids \[2, 3, 4\]"):
        check_export_format("sglang", [2, 3, 4], 8)  # before a run starts (train/main.py)
    check_export_format("sglang", [2, 4, 5], 8)
    check_export_format("hf", [2, 3, 4], 8)


def test_lint_knows_each_engines_reading(tmp_path):
    hf, _ = _export(tmp_path, "hf", 8, [2, 4, 5])
    findings = {f.code: f for f in lint_drafter(hf, _target(8))}
    assert not has_errors(findings.values()), format_findings(list(findings.values()))
    sg = findings["aux-ids-sglang"]  # served by SGLang it would run on other layers: said, not fatal for an hf export
    assert sg.level == "note" and "[3, 5, 6]" in sg.message and "export.format=sglang" in sg.fix
    custom, _ = _export(tmp_path, "hf", 9, [2, 3, 4])
    assert "export.format=sglang" not in {f.code: f for f in lint_drafter(custom, _target(9))}["aux-ids-sglang"].fix

    # The sglang form beside a target of another depth: both engines it is made for take other defaults.
    sglang, _ = _export(tmp_path, "sglang", 8, [2, 4, 5])
    errors = {f.code: f for f in lint_drafter(sglang, _target(10)) if f.level == "error"}
    assert {"aux-ids-vllm", "aux-ids-sglang"} <= set(errors) and "[2, 5, 7]" in errors["aux-ids-vllm"].message

    # An hf export hand-edited to SGLang's convention: vLLM, which the hf form is for, now reads it wrong.
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in hf.iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    c = json.loads((edited / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (edited / "config.json").write_text(json.dumps(c))
    codes = {f.code: f.level for f in lint_drafter(edited, _target(8))}
    assert codes["aux-ids-vllm"] == "error" and "aux-ids-sglang" not in codes

    # No training record (a public checkpoint): the engines disagree and which one is right cannot be told.
    (edited / RECORD).unlink()
    assert "aux-ids-convention" in {f.code for f in lint_drafter(edited, _target(8)) if f.level == "warning"}
