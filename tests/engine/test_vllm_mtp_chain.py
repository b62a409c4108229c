"""Train == serve for drafter=mtp against vLLM 0.32's own code (tests/helpers/vllm_mtp_side.py, run by the serving
engine's python): Fledge's MTP drafter chains its drafts as vLLM's proposer does.

vLLM's ``DeepSeekMultiTokenPredictorLayer.forward`` runs with the drafter's weights on the states the drafter fed
(its decoder layer replayed from the drafter's), and the next draft gets the state vLLM's proposer feeds: draft 1 the
target model's output after its final norm, each later one the second element of the layer's output,
``shared_head.norm(out)`` (deepseek_mtp.py ``return hidden_states, self.shared_head(hidden_states)``;
llm_base_proposer.py ``model_returns_tuple``, its loop's ``last_hidden_states, hidden_states = ret_hidden_states``).
The drafter trained with ``norm_output`` feeds exactly that; one trained without it does not (the negative control,
which the export's lint refuses). The export's config and tensor names are read by vLLM's own functions too.
"""

from __future__ import annotations

import json
import subprocess

import torch
from safetensors.torch import save_file

from fledge.engine_process import engine_python
from fledge.models.drafter import DraftCache
from fledge.models.mtp import checkpoint_tensors
from fledge.serving import mtp_layout
from tests.helpers.engine import engine_marks
from tests.helpers.mtp import mtp_target_config, random_mtp_drafter
from tests.helpers.paths import REPO

pytestmark = engine_marks()

LAYERS, PROMPT, K = 4, 7, 4


def record_chain(drafter, prompt_states: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter's engine-style chain over one prompt (rows 0..S-1: the target's state at t and token t+1), then
    K - 1 greedy drafts each fed the state the step before returned: per step its ids, positions, embeddings, fed
    state and its decoder layer's input and output; plus the module's tensors under the export's names."""
    seen = {}
    hooks = [drafter.module.eh_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("block_in", out)),
             drafter.module.mtp_block.register_forward_hook(lambda m, a, out: seen.__setitem__("block_out", out))]
    rec = {n: t.float() for n, t in checkpoint_tensors(drafter.module).items()
           if "embed_tokens" not in n and "shared_head.head" not in n}
    cache, S = DraftCache(), tokens.shape[0]
    ids, pos, fed = tokens, torch.arange(S), prompt_states
    with torch.no_grad():
        for j in range(K):
            logits, state = drafter.decode_step(ids[None], fed[None], pos[None], cache)
            rec.update({f"ids.{j}": ids, f"positions.{j}": pos, f"embeds.{j}": drafter.embed_tokens(ids),
                        f"fed.{j}": fed, f"block_in.{j}": seen["block_in"][0], f"block_out.{j}": seen["block_out"][0]})
            ids, pos, fed = logits[0, -1:].argmax(-1), pos[-1:] + 1, state[0, -1:]
    for h in hooks:
        h.remove()
    return {n: t.clone().contiguous() for n, t in rec.items()}  # fed.j is a view of block_out.j-1 (pre-norm)


def test_the_mtp_drafter_chains_as_vllm_chains_it(tmp_path):
    config = mtp_layout.build_config({}, random_mtp_drafter(mtp_target_config(LAYERS)).spec, [], 0, 0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    states, tokens = torch.randn(PROMPT, config["hidden_size"], generator=g), torch.randint(3, 2000, (PROMPT,),
                                                                                             generator=g)
    args = [str(tmp_path / "config.json")]
    for norm_output in (True, False):
        drafter = random_mtp_drafter(mtp_target_config(LAYERS), norm_output=norm_output).eval()
        save_file(record_chain(drafter, states, tokens), tmp_path / f"{norm_output}.safetensors")
        args += [str(tmp_path / f"{norm_output}.safetensors"), str(tmp_path / f"{norm_output}.json")]
    subprocess.run([str(engine_python()), str(REPO / "tests/helpers/vllm_mtp_side.py"), *args], check=True,
                   timeout=600, cwd=tmp_path)
    post, pre = (json.loads((tmp_path / f"{v}.json").read_text()) for v in (True, False))

    assert post["architectures"] == ["DeepSeekMTPModel"] and post["model_type"] == "deepseek_mtp"
    assert post["n_predict"] == 1 and post["returns_tuple"]
    assert post["spec_layer"] == [LAYERS]  # every exported tensor is vLLM's MTP layer's
    assert all(("mtp_block." in n) != any(p in n for p in ("enorm", "hnorm", "eh_proj", "shared_head"))
               for n in post["rewritten"])
    assert post["sources"] == dict.fromkeys(post["sources"], True), post["sources"]
    assert len(post["steps"]) == K
    for step in post["steps"]:  # the layer's input, the state fed in and the fed-back state: vLLM's, to fp32
        assert max(step.values()) < 1e-5, post["steps"]
    assert all(s["fed_in"] > 1e-2 for s in pre["steps"][1:]), pre["steps"]  # pre-norm feedback: not vLLM's chain
