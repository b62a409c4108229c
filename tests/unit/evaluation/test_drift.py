"""Attention-drift probe: its probabilities are the ones the drafter's attention used (p @ V reproduces
the attention output), masses split sink / context / drafted correctly, and the fed-back RMS it reports
is the post-norm state's (about 1) for EAGLE-3.1 and the pre-norm residual's for EAGLE-3."""

import pytest
import torch

from fledge.evaluation.drift import DriftProbe, drift_curves
from fledge.evaluation.speculative import DrafterProposer, TargetRunner
from tests.helpers.models import random_drafter, random_llama


@pytest.mark.parametrize("layer", ["llama", "qwen3", "mla"])
def test_probe_probabilities_reproduce_attention_output(layer):
    """For every layer kind (models/layers/): q/k norms (qwen3), MLA's scale and padded width included."""
    target = random_llama()
    drafter = random_drafter(target, layer=layer)
    attn = drafter.midlayer.self_attn
    seen = {}
    attn.o_proj.register_forward_hook(lambda m, inp, out: seen.__setitem__("a", inp[0][0, -1].detach()))
    probe = DriftProbe(drafter)
    prop = DrafterProposer(drafter, probe=probe)
    runner = TargetRunner(target, drafter.spec.aux_layer_ids)
    prompt = [1, 5, 9, 13, 5, 9, 13, 7, 2]
    _, aux = runner.forward(prompt)
    prop.observe(prompt[1:] + [4], aux)
    for depth in range(3):
        if depth:
            prop.propose(prompt + [4], depth + 1)  # re-drafts depths 0..depth; the last record is `depth`
        probs = probe.last_probs  # [Hq, L]
        v = prop.cache.v[0].repeat_interleave(probs.shape[0] // prop.cache.v.shape[1], dim=0)  # [Hq, L, D]
        L = probs.shape[1]
        assert L == prop.n + depth
        out = torch.einsum("hl,hld->hd", probs, v[:, :L])
        out = out[:, : attn.v_dim].reshape(-1) if layer == "mla" else out.reshape(-1)  # MLA pads v to its width
        torch.testing.assert_close(out, seen["a"], atol=1e-5, rtol=1e-4)
    probe.close()


def test_drift_curves_masses_and_rms():
    target = random_llama()
    prompts = [[1, 5, 9, 13, 5, 9, 13, 7], [3, 3, 60, 2, 44, 81, 17]]
    runner = TargetRunner(target, [2, 3, 4])
    s31 = drift_curves(random_drafter(target, norm_output=True), runner, prompts, depth=5)
    s3 = drift_curves(random_drafter(target, norm_output=False), runner, prompts, depth=5)
    for s in (s31, s3):
        assert s["depth"] == [0, 1, 2, 3, 4] and s["count"] == [2] * 5
        total = torch.tensor(s["sink"]) + torch.tensor(s["context"]) + torch.tensor(s["drafted"])
        torch.testing.assert_close(total, torch.ones(5, dtype=total.dtype), atol=1e-5, rtol=0)
        assert s["drafted"][0] == 0 and all(v > 0 for v in s["drafted"][1:])
    # 3.1 feeds back norm(h2): unit RMS times the norm weight (random around 1, so not exactly 1).
    w = random_drafter(target, norm_output=True).norm.weight
    expected = float(w.detach().pow(2).mean().sqrt())
    assert all(abs(v - expected) < 0.25 for v in s31["state_rms"][1:]), s31["state_rms"]
    assert all(abs(v - expected) > 0.25 for v in s3["state_rms"][1:]), s3["state_rms"]
