"""capture.engine=vllm without the engine: the layer-id mapping, the per-sample boundary-convention check
(with planted off-by-ones it must refuse), the head that makes the final normed state and argmax from
layer id L (equal to the HF capture), and the settings handed to vLLM. The engine itself: tests/engine/."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fledge.conf.compose import compose
from fledge.data.capture.engine import (
    DRIVER,
    TargetHead,
    check_boundary_convention,
    check_parallel,
    engine_env,
    engine_layer_ids,
    split_columns,
)
from fledge.models.target import FrozenTarget
from tests.helpers.models import random_llama

AUX, L = [2, 3, 4], 6


def _driver():
    spec = importlib.util.spec_from_file_location("engine_capture_driver", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("random_llama")
    random_llama(seed=3).save_pretrained(d)
    return d


def engine_file(model, ids: torch.Tensor, shift: int = 0) -> tuple[torch.Tensor, int]:
    """What vLLM's hidden-states connector writes for one prompt ([T, n, H] at engine_layer_ids, ascending)
    and the token it samples after it, made with transformers. ``shift`` plants an engine whose id k
    holds the residual stream at k + shift (clamped to [0, L])."""
    pre_norm = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: pre_norm.setdefault("h", a[0]))
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    hook.remove()
    residual = list(out.hidden_states[:L]) + [pre_norm["h"]]  # HF's hidden_states[L] is after the norm
    cols = [residual[min(max(k + shift, 0), L)][0] for k in engine_layer_ids(AUX, L)]
    return torch.stack(cols, dim=1), int(out.logits[0, -1].argmax())


def test_engine_ids_are_fledge_boundary_ids_plus_probes_sorted():
    assert engine_layer_ids([2, 4, 5], 8) == [0, 2, 4, 5, 8]
    assert engine_layer_ids([5, 2, 2], 8) == [0, 2, 5, 8]  # vLLM sorts and de-duplicates; columns map back by id
    states = torch.arange(4.0)[None, :, None].expand(3, 4, 2)  # column j holds the value j
    aux, probe, last = split_columns(states, [0, 2, 5, 8], [5, 2, 2], 8)
    assert aux[0].tolist() == [2, 2, 1, 1, 1, 1] and probe[0, 0] == 0 and last[0, 0] == 3
    with pytest.raises(ValueError, match="aux-layer convention"):  # an engine that returned fewer ids
        split_columns(states[:, :3], [0, 2, 5, 8], [5, 2, 2], 8)


def test_head_on_engine_states_equals_the_hf_capture(model_dir):
    model = random_llama(seed=3)
    head = TargetHead.load(str(model_dir), None, model.config.rms_norm_eps, "cpu", torch.float32)
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(0))
    states, sampled = engine_file(model, ids)
    aux, probe, last = split_columns(states, engine_layer_ids(AUX, L), AUX, L)
    final = head.final_norm(last)
    ref_aux, ref_final, ref_argmax = FrozenTarget(model, AUX).capture(ids[None])
    torch.testing.assert_close(aux, ref_aux[0], rtol=0, atol=0)
    torch.testing.assert_close(final, ref_final[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(head.logits(final).argmax(-1), ref_argmax[0])
    check_boundary_convention(head, ids, probe, head.logits(final[-1:])[0], sampled, 0, torch.float32)


@pytest.mark.parametrize("shift,refusal", [(1, "layer id 0 is not the embedding"), (-1, "engine sampled")])
def test_planted_off_by_one_is_refused(model_dir, shift, refusal):
    """+1: the engine's id k is the output of layer k (SGLang's convention) -> the id-0 probe refuses;
    -1: id L holds layer L-1's output, the probe still passes -> the argmax-vs-sampled check refuses."""
    model = random_llama(seed=3)
    head = TargetHead.load(str(model_dir), None, model.config.rms_norm_eps, "cpu", torch.float32)
    refused = 0
    for seed in range(4):
        ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(seed))
        _, sampled = engine_file(model, ids)
        states, _ = engine_file(model, ids, shift=shift)
        _, probe, last = split_columns(states, engine_layer_ids(AUX, L), AUX, L)
        logits = head.logits(head.final_norm(last[-1:]))[0]
        if shift == -1 and int(logits.argmax()) == sampled:
            continue  # the shifted state happens to give the same token: nothing to see on this sample
        with pytest.raises(ValueError, match=refusal):
            check_boundary_convention(head, ids, probe, logits, sampled, seed, torch.float32)
        refused += 1
    assert refused >= 2


def test_settings_handed_to_vllm():
    drv = _driver()
    req = {"target": "/t", "max_model_len": 64, "layer_ids": [0, 2, 4, 5, 8], "connector_dir": "/c",
           "tensor_parallel_size": 8, "enable_expert_parallel": True, "data_parallel": {"size": 4},
           "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    cpu, gpu = drv.engine_kwargs(req, on_gpu=False), drv.engine_kwargs({**req, "env": {}}, on_gpu=True)
    spec = cpu["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4, 5, 8]
    assert cpu["enable_prefix_caching"] is False  # a cached prefix would skip the forward filling the states
    assert cpu["kv_transfer_config"]["kv_connector_module_path"] == "fledge_capture_connector"
    assert cpu["kv_transfer_config"]["kv_connector_extra_config"]["use_synchronization_lock"] is False
    assert gpu["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"  # vLLM's own, unchanged
    assert "kv_connector_module_path" not in gpu["kv_transfer_config"]
    assert gpu["kv_transfer_config"]["kv_connector_extra_config"]["use_synchronization_lock"] is True
    assert (gpu["tensor_parallel_size"], gpu["enable_expert_parallel"], gpu["data_parallel_size"]) == (8, True, 4)
    floor = drv.engine_kwargs({**req, "floor": True}, on_gpu=True)
    assert "speculative_config" not in floor and "kv_transfer_config" not in floor


def test_parallel_settings_per_rank():
    env = engine_env("cuda", rank=5, local_rank=1, world_size=8, tensor_parallel_size=4, data_parallel_size=8,
                     master_addr="n0", master_port=29501)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # local rank 1's block of 4 GPUs
    assert (env["VLLM_DP_RANK"], env["VLLM_DP_SIZE"], env["VLLM_DP_MASTER_IP"]) == ("5", "8", "n0")
    assert "VLLM_DP_RANK" not in engine_env("cuda", 5, 1, 8, 4, 1, "n0", 29501)  # independent engines
    assert engine_env("cpu", 0, 0, 1, 1, 1, "x", 1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    check_parallel(8, 16, 16, "cuda")
    with pytest.raises(ValueError, match="capture.data_parallel_size=3"):
        check_parallel(1, 3, 4, "cuda")
    with pytest.raises(ValueError, match="capture.tensor_parallel_size=2"):
        check_parallel(2, 1, 1, "cpu")


def test_config_keys():
    cfg = compose(["recipe=tiny", "capture.engine=vllm", "capture.tensor_parallel_size=8",
                   "capture.expert_parallel=true"])
    assert cfg.capture.engine == "vllm" and cfg.capture.tensor_parallel_size == 8
    with pytest.raises(ValueError, match="capture.engine='sglang'"):
        compose(["recipe=tiny", "capture.engine=sglang"])
    online = compose(["recipe=tiny", "capture.engine=vllm", "capture.mode=online", "capture.buffer_batches=2"])
    assert online.capture.mode == "online" and online.capture.buffer_batches == 2
    with pytest.raises(ValueError, match="capture.data_parallel_size=1"):
        compose(["recipe=tiny", "capture.engine=vllm", "capture.mode=online", "capture.data_parallel_size=2"])
    with pytest.raises(ValueError, match="capture.buffer_batches=0"):
        compose(["recipe=tiny", "capture.engine=vllm", "capture.mode=online", "capture.buffer_batches=0"])
    placed = compose(["recipe=tiny", "capture.engine=vllm", "capture.mode=online", "capture.ranks_per_engine=2",
                      "capture.engine_launcher=[srun,'--het-group=1']"])
    assert placed.capture.engine_launcher == ["srun", "--het-group=1"] and placed.capture.ranks_per_engine == 2
    with pytest.raises(ValueError, match="capture.ranks_per_engine=0"):
        compose(["recipe=tiny", "capture.engine=vllm", "capture.mode=online", "capture.ranks_per_engine=0"])
    with pytest.raises(ValueError, match="capture.engine_launcher / capture.ranks_per_engine"):
        compose(["recipe=tiny", "capture.engine=vllm", "capture.ranks_per_engine=2"])
    with pytest.raises(ValueError, match="capture.device_map"):
        compose(["recipe=tiny", "capture.engine=vllm", "capture.device_map=auto"])


def test_capture_hashes_what_changes_the_store():
    """With engine=hf no engine key is hashed; the engine's python and patience never re-run a capture;
    switching the engine does."""
    from fledge.pipeline.stages import capture_inputs
    from fledge.stage_inputs import hashed as hashed_inputs

    def hashed(*overrides):
        return hashed_inputs(capture_inputs(compose(["recipe=tiny", *overrides])))

    hf = hashed()["capture"]
    assert not {"engine", "tensor_parallel_size", "engine_python", "engine_timeout_s"} & set(hf)
    vllm = hashed("capture.engine=vllm")
    moved = hashed("capture.engine=vllm", "capture.engine_python=/x/python", "capture.engine_timeout_s=5")
    assert vllm == moved and vllm["capture"]["engine"] == "vllm"
