"""train.optim.name=muon (train/optimizers.py): which parameters Muon takes, its step against torch.optim.Muon's (the
implementation scripts/bench_levers.py measured the lever with), what the schema refuses with it, that runs before it
keep their hashes, and that a Muon checkpoint is refused on another world size in one line. Under DeepSpeed (ZeRO-1/2
on two gloo ranks, exact resume): tests/distributed/test_muon.py."""

from __future__ import annotations

import pytest
import torch

from fledge.conf import compose
from fledge.distributed import World
from fledge.pipeline.stages import STAGES, train_inputs
from fledge.stage_inputs import hashed
from fledge.train import checkpoint
from fledge.train.deepspeed_setup import deepspeed_config, lr_lambda
from fledge.train.optimizers import MuonAdamW, build_optimizer, muon_split, ns_dtype, orthogonalize
from fledge.train.ttt_model import TTTModel
from tests.helpers.models import FLAGS, make_drafter, packed_batch
from tests.helpers.muon_entry import one_thread, tiny_model

MUON = ["train.optim.name=muon"]


def _inputs(*overrides):
    return train_inputs(compose(["recipe=tiny", *overrides]))


def test_muon_takes_the_hidden_linear_weights_and_adamw_the_rest():
    model = TTTModel(make_drafter(**FLAGS["eagle31"]), torch.zeros(40, 32), None)
    names = {id(p): n.removeprefix("drafter.") for n, p in model.named_parameters()}
    muon, rest = muon_split(model)
    assert [names[id(p)] for p in muon] == [
        "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"]
    assert [names[id(p)] for p in rest] == [  # the frozen embedding has no optimizer
        "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight"]
    o = _inputs(*MUON).train.optim
    opt = build_optimizer(model, o)
    assert [g["muon"] for g in opt.param_groups] == [False, True]  # AdamW's first: the lr the trainer logs
    assert opt.param_groups[1]["lr"] == o.lr and opt.param_groups[1]["weight_decay"] == 0.1
    assert type(build_optimizer(model, _inputs().train.optim)) is torch.optim.AdamW  # the default, as before


def test_a_step_is_torch_muon_on_the_matrices_and_adamw_on_the_rest_bit_for_bit(monkeypatch):
    """torch.optim.Muon (match_rms_adamw, speculators' momentum 0.95 and weight decay 0.1) over the matrices and
    AdamW over the rest, each under the run's lr schedule, as scripts/bench_levers.py measured the lever before the
    option existed: the same weights after every step, with the Newton-Schulz iteration in torch's bf16 (on a CPU
    Fledge runs it in fp32: the next test)."""
    monkeypatch.setattr("fledge.train.optimizers.ns_dtype", lambda device: torch.bfloat16)
    o = _inputs(*MUON, "train.optim.lr=1e-2", "train.optim.warmup_steps=1", "train.optim.weight_decay=0.01").train.optim
    ours, theirs = tiny_model(), tiny_model()
    muon, rest = muon_split(theirs)
    reference = [torch.optim.Muon(muon, lr=o.lr, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW(rest, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)]
    optimizers = {ours: [build_optimizer(ours, o)], theirs: reference}
    schedules = {m: [torch.optim.lr_scheduler.LambdaLR(x, lr_lambda(o, 4)) for x in opts]
                 for m, opts in optimizers.items()}
    batch = packed_batch()
    with one_thread():
        for _ in range(3):
            for model in (ours, theirs):
                for x in optimizers[model]:
                    x.zero_grad()
                model(batch).loss.backward()
                for x in optimizers[model] + schedules[model]:
                    x.step()
            for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
                assert torch.equal(a, b), name
    assert not torch.equal(ours.drafter.fc.weight, tiny_model().drafter.fc.weight)


def test_on_a_cpu_newton_schulz_runs_in_fp32_and_agrees_with_bf16_to_bf16s_precision():
    """fp32 on a CPU (a step measured 4.6x slower in bf16 there), bf16 on an accelerator as torch's; the two updates
    are the same orthogonalization: a cosine of ~1 and singular values near 1 in both (what Muon's step relies on)."""
    assert ns_dtype(torch.device("cpu")) == torch.float32 and ns_dtype(torch.device("cuda")) == torch.bfloat16
    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    ours, torchs = orthogonalize(g), orthogonalize(g, torch.bfloat16).float()
    assert ours.dtype == torch.float32 and not torch.equal(ours, torchs)
    assert torch.nn.functional.cosine_similarity(ours.flatten(), torchs.flatten(), dim=0) > 0.999
    for x in (ours, torchs):
        s = torch.linalg.svdvals(x)
        assert 0.5 < s.min() and s.max() < 1.5, s  # the quintic's band around 1, not an exact polar factor


@pytest.mark.parametrize("overrides,keys", [
    (["deepspeed=zero3"], "deepspeed.zero_stage 0, 1 or 2, not 3"),
    (["deepspeed=zero2_offload"], "drop deepspeed.offload_optimizer"),
])
def test_muon_is_refused_where_it_cannot_run(overrides, keys):
    with pytest.raises(ValueError, match="train.optim.name=muon") as e:
        compose(["recipe=tiny", *MUON, *overrides])
    assert keys in str(e.value) and "\n" not in str(e.value)


def test_the_option_hashes_only_when_set_and_moves_the_train_stage_only():
    """Runs of the Fledge before the option hashed no train.optim.name (nor Muon's keys): at their defaults they are
    left out, so those runs keep their hashes (tests/unit/pipeline/test_recorded_inputs.py); muon is hashed."""
    base, muon = compose(["recipe=tiny"]), compose(["recipe=tiny", *MUON])
    optim = hashed(train_inputs(base))["train"]["optim"]
    assert not {"name", "muon_lr", "muon_momentum", "muon_weight_decay"} & set(optim) and "lr" in optim
    assert hashed(train_inputs(muon))["train"]["optim"] == {**optim, "name": "muon"}
    assert {n for n, s in STAGES.items() if hashed(s.inputs(base)) != hashed(s.inputs(muon))} == {"train"}
    assert deepspeed_config(train_inputs(muon), World(0, 1, 0, torch.device("cpu")))["zero_allow_untested_optimizer"]
    assert "zero_allow_untested_optimizer" not in deepspeed_config(train_inputs(base), World(0, 1, 0,
                                                                                               torch.device("cpu")))


def test_a_muon_checkpoint_on_another_world_size_is_one_line_naming_the_one_that_resumes_it(tmp_path):
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "trainer.json").write_text('{"world_size": 2}')
    with pytest.raises(ValueError) as e:
        checkpoint.to_universal(tmp_path, "step_00000002", World(0, 1, 0, torch.device("cpu")),
                                _inputs(*MUON).train.optim)
    msg = str(e.value)
    assert "train.optim.name=muon" in msg and "resume on 2 ranks" in msg and "run.force=[train]" in msg, msg
    assert "\n" not in msg and not (tmp_path / "step_00000002_universal").exists()


def test_muon_adamw_without_matrices_or_without_the_rest():
    """A model all of whose trainable parameters one side takes still builds (one group)."""
    lin = torch.nn.Linear(4, 3, bias=False)
    only = MuonAdamW(*muon_split(lin), muon_lr=0.1, momentum=0.9, muon_weight_decay=0.0, lr=0.1)
    assert [g["muon"] for g in only.param_groups] == [True]
    lin(torch.ones(2, 4)).sum().backward()
    before = lin.weight.detach().clone()
    only.step()
    assert not torch.equal(before, lin.weight)
