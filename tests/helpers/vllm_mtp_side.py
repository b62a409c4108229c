"""The vLLM side of the MTP train == serve check (tests/engine/test_vllm_mtp_chain.py); run it with the serving
engine's python (.engine/venv: vLLM 0.32 on CPU):

    python tests/helpers/vllm_mtp_side.py CONFIG.json IN.safetensors OUT.json [IN2 OUT2 ...]

Each IN holds what Fledge's MTP drafter did over one chain (a prefill of S rows, then one row per further draft): per
step j its ``ids.j``, ``positions.j``, ``embeds.j`` (the target's embedding of the ids), ``fed.j`` (the state it fed
in), ``block_in.j`` and ``block_out.j`` (the decoder layer's input and output), plus the module's ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head.norm`` weights. CONFIG is the export's config.json.

It runs vLLM's own ``DeepSeekMultiTokenPredictorLayer.forward`` (model_executor/models/deepseek_mtp.py) with those
weights and vLLM's RMSNorm, its decoder layer replaced by a replay of Fledge's (the one part whose parity is the
target's own layer, models/mtp.py's concern), and chains the drafts as vLLM's proposer does: the state it feeds the
next draft is the element of the layer's output that ``SpecDecodeBaseProposer.propose`` feeds (the second when
``model_returns_tuple()``, which it asks vLLM's own method, for the draft config vLLM derives from CONFIG). It
writes, per step, how far vLLM's layer input, its fed-back state and its logits' state are from Fledge's, and what
vLLM makes of the export's config and tensor names. Imports nothing from Fledge.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig
from vllm.config import SpeculativeConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP, DeepSeekMultiTokenPredictorLayer, SharedHead
from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


class Replay(nn.Module):
    """The decoder layer's place in vLLM's MTP layer: hands back Fledge's output for Fledge's input, keeping how far
    vLLM's input to it is from Fledge's (DeepseekV2DecoderLayer returns (out - residual, residual), residual None)."""

    use_sequence_parallel_moe = False

    def __init__(self) -> None:
        super().__init__()
        self.want_in = self.out = None
        self.diff = None

    def forward(self, positions, hidden_states, residual):
        assert residual is None
        self.diff = float((hidden_states - self.want_in).abs().max())
        return self.out - hidden_states, hidden_states


def mtp_layer(config, w: dict) -> DeepSeekMultiTokenPredictorLayer:
    """vLLM's MTP layer class with Fledge's weights, built without the engine (its __init__ wants a VllmConfig)."""
    layer = DeepSeekMultiTokenPredictorLayer.__new__(DeepSeekMultiTokenPredictorLayer)
    nn.Module.__init__(layer)
    H, eps = config.hidden_size, config.rms_norm_eps
    layer.enorm, layer.hnorm = RMSNorm(H, eps=eps), RMSNorm(H, eps=eps)
    layer.eh_proj = nn.Linear(2 * H, H, bias=False)
    layer.shared_head = SharedHead(config, "shared_head", defer_lm_head=True)
    layer.mtp_block = Replay()
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        layer.get_parameter(name).data.copy_(w[name])
    return layer


def source_facts() -> dict:
    """What vLLM's code says about the states it feeds, read from the functions themselves: draft 1 reads the target
    model's output, after its final norm; a later draft reads the second element of the MTP layer's output (the
    proposer's loop keeps it in its hidden-state buffer, the model's next input) and samples from the first."""
    import inspect

    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Model
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model = inspect.getsource(DeepseekV2Model.forward)
    loop = inspect.getsource(SpecDecodeBaseProposer.propose).split("for token_index in range(")[1]
    runner = inspect.getsource(GPUModelRunner)
    return {
        "target_output_is_normed": model.rstrip().endswith("return hidden_states")
        and "hidden_states, _ = self.norm(hidden_states, residual)" in model,
        "no_mtp_state_override": not hasattr(DeepseekV2ForCausalLM, "get_mtp_target_hidden_states"),
        "runner_feeds_model_output": "target_hidden_states = hidden_states[:num_scheduled_tokens]" in runner,
        "loop_unpacks_pair": "last_hidden_states, hidden_states = ret_hidden_states" in loop,
        "loop_feeds_second": "self.hidden_states[:batch_size] = hidden_states" in loop
        and 'model_kwargs["hidden_states"] = self.hidden_states[:input_batch_size]' in loop,
        "loop_samples_first": "last_hidden_states[:batch_size], sampling_metadata" in loop,
    }


def main(config_path: str, inputs: str, out_path: str) -> None:
    t = load_file(inputs)
    raw = json.loads(open(config_path).read())
    export = os.path.dirname(os.path.abspath(config_path))
    draft = SpeculativeConfig.hf_config_override(AutoConfig.from_pretrained(export))  # vLLM's draft config
    proposer = SimpleNamespace(method="mtp", draft_model_config=SimpleNamespace(hf_config=draft))
    returns_tuple = SpecDecodeBaseProposer.model_returns_tuple(proposer)
    L = raw["num_hidden_layers"]
    names = [n for n in t if n.startswith(f"model.layers.{L}.")]
    report = {"architectures": draft.architectures, "model_type": draft.model_type, "n_predict": draft.n_predict,
              "returns_tuple": returns_tuple,
              "spec_layer": sorted({get_spec_layer_idx_from_weight_name(draft, n) for n in names}),
              "rewritten": sorted({DeepSeekMTP._rewrite_spec_layer_name(None, L, n) for n in names}), "steps": [],
              "sources": source_facts()}
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        layer = mtp_layer(draft, {n[len(f"model.layers.{L}."):]: t[n] for n in names})
        fed = t["fed.0"]
        j = 0
        while f"ids.{j}" in t:
            layer.mtp_block.want_in, layer.mtp_block.out = t[f"block_in.{j}"], t[f"block_out.{j}"]
            ret = layer(t[f"ids.{j}"], t[f"positions.{j}"], fed, t[f"embeds.{j}"], spec_step_index=j)
            # propose(): "last_hidden_states, hidden_states = ret_hidden_states" when it returns a tuple
            logits_state, next_fed = ret if returns_tuple else (ret, ret)
            report["steps"].append({
                "fed_in": float((fed - t[f"fed.{j}"]).abs().max()),
                "block_in": layer.mtp_block.diff,
                "logits_state": float((layer.shared_head(logits_state) - layer.shared_head(t[f"block_out.{j}"]))
                                      .abs().max()),
                "next_fed_is_post_norm": float((next_fed - layer.shared_head(t[f"block_out.{j}"])).abs().max())})
            fed = next_fed[-1:]  # the draft row's state, fed with the token just drafted
            j += 1
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    for i in range(2, len(sys.argv), 2):  # vLLM's imports paid once for every chain
        main(sys.argv[1], sys.argv[i], sys.argv[i + 1])
