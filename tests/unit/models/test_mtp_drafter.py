"""The MTP drafter (models/mtp_drafter.py): the target's own MTP module (models/mtp.py) run as a chain drafter, its
training unroll equal to the engine-style chain, the fed-back state its norm_output picks, its spec, the target's
final normed state as aux id L, the training build from the target's own module, and the drift probe on it.
(tests/engine/test_vllm_mtp_chain.py holds the chain to vLLM 0.32's own code.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fledge.conf import compose
from fledge.evaluation.drift import drift_curves
from fledge.evaluation.speculative import TargetRunner
from fledge.models import alignment
from fledge.models.algorithms import DrafterSpec, algorithm_of
from fledge.models.drafter import DraftCache
from fledge.models.mtp import MTPModule, checkpoint_tensors
from fledge.models.mtp_drafter import MtpDrafter, MtpSpec
from fledge.models.target import FrozenTarget
from fledge.models.weights import read_tensors
from fledge.pipeline.stages import train_inputs
from fledge.run_layout import RunLayout
from fledge.train.ttt_model import build_ttt_model
from tests.helpers.mtp import random_mtp_drafter, save_random_mtp_target, target_config

L, H, V = 4, 128, 2560  # the tiny mla_mtp shape with 4 layers (recipe=tiny_mla told so)
RECIPE = ["recipe=tiny_mla", "drafter=mtp", f"target.num_hidden_layers={L}", "drafter.aux_layer_ids=[2,3]"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_random_mtp_target(tmp_path_factory.mktemp("mtp_target"), layers=L)


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _inputs(T=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, generator=g), torch.randint(0, V, (1, T + 4), generator=g), torch.arange(T)[None]


def test_the_drafter_runs_the_module_as_its_own_forward(target):
    """One engine-style prefill of the drafter = models/mtp.py's own forward (transformers' sdpa, causal), and its
    fed-back state is the module's ``feedback``: the drafter adds nothing to the module's math."""
    drafter = random_mtp_drafter(target)
    config = drafter.spec.module_config()
    config._attn_implementation = "sdpa"
    module = MTPModule(config, drafter.embed_tokens, drafter.lm_head)
    module.load_state_dict(drafter.module.state_dict())
    h, x, pos = _inputs()
    out, logits = module(h, x[:, 1:13], pos)
    got, fed = drafter.decode_step(x[:, 1:13], drafter.fuse(h), pos, DraftCache())
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fed, module.feedback(out), rtol=1e-4, atol=1e-5)
    assert torch.equal(drafter.draft_to_target(torch.arange(V)), torch.arange(V)) and bool(drafter.t2d.all())


@pytest.mark.parametrize("norm_output,attention", [(True, "sdpa"), (False, "dense")])
def test_training_steps_are_the_engine_chain(target, norm_output, attention):
    """TTT step k at row t (teacher forcing, models/alignment.py) = the k-th chained draft after committing rows
    0..t with the engine path, each draft fed the state the step before returned: train == the harness's chain."""
    drafter = random_mtp_drafter(target, norm_output=norm_output, attention=attention)
    h, x, pos = _inputs()
    T = pos.shape[1]
    ys = alignment.unroll(drafter, h, x[:, :T], pos, torch.zeros(1, T, dtype=torch.int32), 3)
    for t in (0, 5, T - 4):  # the last row whose step-2 token x_{t+3} is in the row
        cache = DraftCache()
        logits, state = drafter.decode_step(x[:, 1:t + 2], h[:, :t + 1], pos[:, :t + 1], cache)
        steps = [logits[0, -1]]
        state = state[:, -1:]
        for k in (1, 2):
            logits, state = drafter.decode_step(x[:, t + 1 + k:t + 2 + k], state, pos[:, t:t + 1] + k, cache)
            steps.append(logits[0, -1])
        for k, want in enumerate(steps):
            torch.testing.assert_close(drafter.lm_head(ys[k][0, t]), want, rtol=1e-4, atol=2e-5)


def test_norm_output_picks_the_fed_back_state(target):
    """norm_output: the next draft reads shared_head.norm(out) (vLLM 0.32's chain); without it, out itself."""
    post, pre = random_mtp_drafter(target, norm_output=True), random_mtp_drafter(target, norm_output=False)
    h, x, pos = _inputs()
    _, fed_post = post.decode_step(x[:, 1:13], h, pos, DraftCache())
    _, fed_pre = pre.decode_step(x[:, 1:13], h, pos, DraftCache())
    torch.testing.assert_close(post.module.feedback(fed_pre), fed_post)  # same weights: post = norm(pre)
    assert (fed_pre - fed_post).abs().max() > 0.1


def test_the_spec_reads_the_final_normed_state_over_the_whole_vocab(target):
    spec = MtpSpec.from_target_config(target_config(target), {"algorithm": "mtp", "aux_layer_ids": [2, 4, 5]})
    assert algorithm_of(spec).vllm_method == "mtp" and algorithm_of(spec).target_head
    assert spec.aux_layer_ids == [L] and spec.draft_vocab_size == V and spec.norm_output
    assert DrafterSpec.from_dict(spec.to_dict()) == spec  # the flat JSON a checkpoint keeps
    with pytest.raises(ValueError, match=rf"final normed state, aux_layer_ids=\[{L}\]"):
        dataclasses.replace(spec, aux_layer_ids=[2, 4, 5])
    with pytest.raises(ValueError, match="model_type 'llama'"):
        dataclasses.replace(spec, target_config={**spec.target_config, "model_type": "llama"})


def test_aux_id_L_is_the_final_normed_state(hf_target):
    """What the MTP module reads at draft 1: FrozenTarget's id L (capture, held-out) and TargetRunner's (the harness,
    drift) are the state after the final norm, the one the teacher and vLLM's MTP read."""
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(0))
    aux, final, _ = FrozenTarget(hf_target, [2, L]).capture(ids)
    torch.testing.assert_close(aux[..., H:], final)
    _, runner_aux = TargetRunner(hf_target, [L]).forward(ids[0].tolist())
    torch.testing.assert_close(runner_aux, final[0])
    torch.testing.assert_close(hf_target.lm_head(final), hf_target(ids).logits)


def test_training_starts_from_the_targets_own_module(target, tmp_path):
    """drafter=mtp builds the module from the target's checkpoint (model.layers.L.*), with the target's embedding and
    lm_head frozen; the loss trains the module only, its first step reading the final normed state."""
    cfg = compose([*RECIPE, f"target.name_or_path={target}"])
    model = build_ttt_model(train_inputs(cfg), RunLayout(tmp_path).prepare.vocab, torch.device("cpu"))
    drafter = model.drafter
    assert isinstance(drafter, MtpDrafter) and drafter.spec.norm_output
    saved = read_tensors(target)
    for name, t in checkpoint_tensors(drafter.module).items():
        assert torch.equal(t, saved[name].to(t.dtype)), name
    assert torch.equal(drafter.lm_head.weight, saved["lm_head.weight"]) and torch.equal(model.teacher_head,
                                                                                       saved["lm_head.weight"])
    from tests.helpers.models import packed_batch

    batch = packed_batch(H=H)
    batch = dataclasses.replace(batch, input_ids=batch.input_ids % V, target_argmax=batch.target_argmax % V)
    model(batch).loss.backward()
    grads = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {f"layers.{L}.eh_proj.weight", f"layers.{L}.shared_head.norm.weight"} <= grads
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in grads)
    shuffled = dataclasses.replace(batch, aux_hidden=torch.randn_like(batch.aux_hidden))  # aux states: unread
    assert torch.equal(model(shuffled).loss.detach(), model(batch).loss.detach())


def test_a_target_without_its_mtp_layer_is_refused(target, tmp_path):
    """No model.layers.L.* tensors: one line naming the target (the module starts from the target's own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    tensors = {n: t for n, t in load_file(bare / "model.safetensors").items() if not n.startswith(f"model.layers.{L}.")}
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    cfg = compose([*RECIPE, f"target.name_or_path={bare}"])
    with pytest.raises(ValueError, match=f"holds no model.layers.{L}"):
        build_ttt_model(train_inputs(cfg), RunLayout(tmp_path).prepare.vocab, torch.device("cpu"))


@pytest.mark.parametrize("override,match", [
    ("drafter.fc_norm=true", "hnorm and enorm"), ("train.sequence_parallel=2", "sequence_parallel=1"),
    ("export.format=speculators", "export.format=hf"), ("eval.engine=sglang", "eval.engine=vllm or hf"),
])
def test_config_refuses_what_the_mtp_module_does_not_have(override, match):
    assert compose(["recipe=tiny_mla", "drafter=mtp"]).drafter.algorithm == "mtp"
    with pytest.raises(ValueError, match=match):
        compose(["recipe=tiny_mla", "drafter=mtp", override])


def test_drift_probe_follows_the_module_chained_as_vllm_chains_it(target, hf_target):
    """evaluation/drift.py on the MTP drafter: per depth the attention mass splits over sink, context and this round's
    drafts (none at depth 0), and state_rms is the RMS of the state fed in: the final normed state at depth 0, then
    shared_head.norm(out) (norm_output) or out, which differ."""
    runner = TargetRunner(hf_target, [L])
    prompts = [torch.randint(3, V, (10,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    curves = {}
    for norm_output in (True, False):
        drafter = random_mtp_drafter(target, norm_output=norm_output).eval()
        curves[norm_output] = drift_curves(drafter, runner, prompts, depth=3)
        assert drafter._watch is None  # the probe closed
    post, pre = curves[True], curves[False]
    assert post["depth"] == [0, 1, 2] and post["count"] == [2] * 3
    for c in (post, pre):
        total = [s + x + d for s, x, d in zip(c["sink"], c["context"], c["drafted"])]
        assert max(abs(t - 1) for t in total) < 1e-5 and c["drafted"][0] == 0 < min(c["drafted"][1:])
    assert post["state_rms"][0] == pytest.approx(pre["state_rms"][0])  # the target's own state at depth 0
    assert all(abs(a - b) > 1e-3 for a, b in zip(post["state_rms"][1:], pre["state_rms"][1:]))
