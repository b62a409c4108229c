"""scripts/bench_levers.py (the sample-efficiency levers): its variants name only the levers it has and their config
overrides compose on a run's config, it refuses bad input in one line (exit 2), and on a captured tiny store it trains
two variants, writes the JSON lines and the table, and a re-run skips what is there."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from tests.helpers.cli import fledge_run
from tests.helpers.paths import REPO

spec = importlib.util.spec_from_file_location("bench_levers", REPO / "scripts" / "bench_levers.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
LEVER_KEYS = {"cfg", "head", "warmup_pct", "norm_init", "nbr", "vocab", "layer_init", "bf16"}


def test_variant_table_names_only_known_levers():
    assert {"fledge", "frozen_head", "muon", "muon_frozen", "w1", "clip1", "linear_1pct", "norm_init", "nbr", "nbfc",
            "peer", "peer_arch"} <= set(bench.VARIANTS)
    assert bench.VARIANTS["fledge"] == {}
    for name, lever in bench.VARIANTS.items():
        assert set(lever) <= LEVER_KEYS, name
        assert lever.get("head", "frozen") == "frozen", name
    for name in ("muon", "muon_frozen", "peer", "peer_arch", *(v for v in bench.VARIANTS if v.startswith("muon_"))):
        assert "train.optim.name=muon" in bench.VARIANTS[name]["cfg"], name


def test_refusals_are_one_line_with_exit_2(tmp_path, capsys):
    assert bench.main([str(tmp_path), "--variants", "fledge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no complete prepare stage" in err[0] and "run.stages=[prepare,capture]" in err[0], err
    assert bench.main([str(tmp_path), "--variants", "fledge", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--variants nope: no such variant" in err[0] and "peer_arch" in err[0], err


@pytest.fixture(scope="module")
def captured(tmp_path_factory, random_tiny_target, tiny_data):
    """A prepared and captured tiny run (random target, 12 conversations)."""
    root = tmp_path_factory.mktemp("levers")
    res = fledge_run(root, "run.stages=[prepare,capture]", f"target.name_or_path={random_tiny_target}",
                     f"data.sources=[{{path: {tiny_data}/train.jsonl, max_samples: 12}}]",
                     f"data.eval_sources=[{{path: {tiny_data}/eval.jsonl, max_samples: 4}}]")
    assert res.returncode == 0, res.stderr[-4000:]
    return root / "out" / "tiny"


def test_two_variants_train_and_a_rerun_skips_them(captured, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(captured, run)
    (run / "capture" / "manifest.json").rename(run / "manifest.json")
    assert bench.main([str(run), "--steps", "2", "--tokens", "256", "--variants", "fledge"]) == 2
    assert "no complete capture stage" in capsys.readouterr().err
    (run / "manifest.json").rename(run / "capture" / "manifest.json")
    for name, lever in bench.VARIANTS.items():  # every variant's overrides are keys and values the schema takes
        assert bench.load_config(run, lever.get("cfg", [])).run.name == "tiny", name
    # 2,048 tokens: the random target's argmax falls in the draft vocab at 81 rows of seed 0's first batch (at 256
    # tokens: one row, whose argmax moved out of the vocab on a CI CPU that rounds differently: a loss of 0, no step)
    args = [str(run), "--steps", "2", "--tokens", "2048", "--threads", "1", "--out", str(tmp_path / "o"),
            "--variants", "fledge", "peer_arch", "muon_vocab_x0.5", "muon_ttt5", "muon_layer_init"]
    assert bench.main(args) == 0
    recs = [json.loads(line) for line in (tmp_path / "o" / "levers.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in recs] == ["fledge", "peer_arch", "muon_vocab_x0.5", "muon_ttt5", "muon_layer_init"]
    assert recs[2]["draft_vocab_size"] == recs[0]["draft_vocab_size"] // 2
    for r in recs:  # scored at the run's K, whatever K a variant trains with
        assert len(r["heldout_acc"]) == len(r["heldout_peer_style_full_acc"]) == 3 and r["steps"] == 2
        assert r["heldout_al_estimate"] >= 1 and r["train_s"] >= 0 and r["machine"] and r["date"]
    assert recs[0]["head_drift"] > 0 == recs[1]["head_drift"]  # peer_arch freezes the lm_head
    md = (tmp_path / "o" / "levers.md").read_text()
    assert "| fledge | 0 | 2 x 2048 |" in md and "| peer_arch | 0 | 2 x 2048 |" in md and "peer-style" in md
    capsys.readouterr()
    assert bench.main(args) == 0
    assert capsys.readouterr().out.count("already in") == 5


def test_layer_init_copies_the_targets_last_layer_into_the_state_half(captured):
    """layer_init: the MLP, o_proj and norms as the target's last layer has them, its q/k/v in the columns that read
    the state (the second half of [embedding, state]), the embedding half as the drafter drew it."""
    import torch

    from fledge.models.weights import read_tensors
    from fledge.pipeline.stages import train_inputs
    from fledge.run_layout import RunLayout
    from fledge.train.ttt_model import build_ttt_model

    cfg = bench.load_config(captured, [])
    d = build_ttt_model(train_inputs(cfg), RunLayout(captured).prepare.vocab, torch.device("cpu")).drafter
    m, H = d.midlayer, d.midlayer.hidden_norm.weight.shape[0]
    drawn = m.self_attn.q_proj.weight[:, :H].clone()
    bench.init_from_last_layer(d, cfg.target.name_or_path, None)
    t = read_tensors(cfg.target.name_or_path)
    last = max(int(k.split(".layers.")[1].split(".")[0]) for k in t if ".layers." in k)
    w = {k.split(f".layers.{last}.")[1]: v for k, v in t.items() if f".layers.{last}." in k}
    assert torch.equal(m.mlp.down_proj.weight, w["mlp.down_proj.weight"].float())
    assert torch.equal(m.self_attn.o_proj.weight, w["self_attn.o_proj.weight"].float())
    assert torch.equal(m.hidden_norm.weight, w["input_layernorm.weight"].float())
    assert torch.equal(m.self_attn.k_proj.weight[:, H:], w["self_attn.k_proj.weight"].float())
    assert torch.equal(m.self_attn.q_proj.weight[:, :H], drawn)


def test_layer_init_refuses_a_target_whose_layer_does_not_fit(captured, tmp_path):
    """A target whose last layer is not the drafter's shape (another hidden size, another layer kind) is refused in
    one message naming the variant and the tensors, not a shape error from copy_."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fledge.pipeline.stages import train_inputs
    from fledge.run_layout import RunLayout
    from fledge.train.ttt_model import build_ttt_model

    cfg = bench.load_config(captured, [])
    d = build_ttt_model(train_inputs(cfg), RunLayout(captured).prepare.vocab, torch.device("cpu")).drafter
    target = tmp_path / "target"
    shutil.copytree(cfg.target.name_or_path, target)
    f = next(target.glob("*.safetensors"))
    t = load_file(str(f))
    key = max((k for k in t if k.endswith("mlp.down_proj.weight")),
              key=lambda k: int(k.split(".layers.")[1].split(".")[0]))
    t[key] = t[key][:, :-1].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(bench.Refused, match=r"muon_layer_init: .*mlp\.down_proj\.weight"):
        bench.init_from_last_layer(d, str(target), None)


def test_bf16_trains_in_bf16_where_native_and_is_refused_where_emulated(captured, tmp_path, monkeypatch, capsys):
    """muon_bf16 trains the drafter's module in bf16 (fp32 master weights, as deepspeed.bf16) and scores it in fp32;
    on a CPU without native bf16 it is one line naming why, exit 2, not a run ~80x slower."""
    import torch

    seen = []
    real = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: seen.append(x.dtype) or real(self, x))
    args = [str(captured), "--steps", "1", "--tokens", "2048", "--threads", "1", "--variants", "muon_bf16"]  # as above
    monkeypatch.setenv("FLEDGE_CPU_BF16", "0")
    assert bench.main([*args[:-1], "fledge", "muon_bf16", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--variants muon_bf16" in err[0] and "FLEDGE_CPU_BF16=0" in err[0], err
    assert not (tmp_path / "no" / "levers.jsonl").exists()  # refused before the variant listed first trained
    monkeypatch.setenv("FLEDGE_CPU_BF16", "1")
    assert bench.main([*args, "--out", str(tmp_path / "yes")]) == 0
    rec = json.loads((tmp_path / "yes" / "levers.jsonl").read_text())
    assert rec["variant"] == "muon_bf16" and rec["heldout_al_estimate"] >= 1
    # a step that had a gradient, and the master weights' step reached the bf16 module that was scored
    assert rec["first_grad_norms"][0] > 0 and rec["head_drift"] > 0
    assert torch.bfloat16 in seen and torch.float32 in seen  # trained in bf16, scored in fp32
