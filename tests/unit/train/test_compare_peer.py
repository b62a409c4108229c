"""scripts/peer_store.py, the first stage of scripts/compare_peer.py: a tiny synthetic Fledge capture written in vLLM
speculators' offline format reads back through the peer's own file reader (hs_connectors, from .oracle/site) with the
shapes and keys its ArrowDataset takes, the un-normed last state gives the target's argmax again, the held-out rows
follow the train rows at the peer's split, and the draft vocabulary is the prepare stage's. Skipped without the oracle
environment (scripts/setup_oracle.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.run_layout import RunLayout
from tests.helpers.paths import REPO

ORACLE = REPO / ".oracle" / "site"
pytestmark = pytest.mark.skipif(not (ORACLE / "hs_connectors").is_dir(), reason="no .oracle (scripts/setup_oracle.sh)")
spec = importlib.util.spec_from_file_location("compare_peer", REPO / "scripts" / "compare_peer.py")
compare_peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_peer)
peer_store = compare_peer.peer_store

H, V, VD, N_AUX, EPS = 16, 40, 24, 3, 1e-5


def write_target(path, g):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"rms_norm_eps": EPS, "hidden_size": H, "vocab_size": V}))
    save_file({"model.norm.weight": torch.rand(H, generator=g) + 0.5, "lm_head.weight": torch.randn(V, H, generator=g),
               "model.embed_tokens.weight": torch.randn(V, H, generator=g)}, str(path / "model.safetensors"))
    return load_file(str(path / "model.safetensors"))


def write_store(store, target, target_dir, g, shards):
    """A Fledge store (data/features/store.py's layout): ``shards`` = [[(sample id, length), ...], ...]."""
    w, head = target["model.norm.weight"], target["lm_head.weight"]
    (store / "rank00000").mkdir(parents=True)
    index = []
    for n, part in enumerate(shards):
        tensors, rows, offset = [], [], 0
        for sid, T in part:
            h = torch.randn(T, H, generator=g) * 3
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w
            tensors.append({"input_ids": torch.randint(0, V, (T,), generator=g, dtype=torch.int32),
                            "loss_mask": (torch.arange(T) >= T // 2).to(torch.uint8),
                            "aux_hidden": torch.randn(T, N_AUX * H, generator=g).bfloat16(),
                            "target_hidden": normed.bfloat16(),
                            # from the state as the target computed it, before the store's bf16
                            "target_argmax": (normed @ head.T).argmax(-1).int()})
            rows.append([sid, offset, T])
            offset += T
        name = f"shard-{n:05d}.safetensors"
        save_file({k: torch.cat([t[k] for t in tensors]) for k in tensors[0]}, str(store / "rank00000" / name))
        index.append({"name": name, "samples": rows, "tokens": offset})
    (store / "rank00000" / "index.json").write_text(json.dumps({"complete": True, "shards": index}))
    (store / "store.json").write_text(json.dumps({"complete": True, "indexes": ["rank00000"],
                                                  "aux_layer_ids": [1, 2, 3],
                                                  "target": {"name_or_path": str(target_dir)}}))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The synthetic run and its conversion, made once for the module: (layout, target tensors, conversion record)."""
    layout, target = make_run(tmp_path_factory.mktemp("peer"))
    return layout, target, peer_store.convert_run(layout.root, layout.root.parent / "peer")


def make_run(tmp_path):
    g = torch.Generator().manual_seed(0)
    target = write_target(tmp_path / "target", g)
    layout = RunLayout(tmp_path / "run")
    stores = {"train": layout.capture.store("train"), "eval": layout.capture.store("eval")}
    write_store(stores["train"], target, tmp_path / "target", g, [[(2, 7), (0, 5)], [(1, 9)]])  # ids out of order
    write_store(stores["eval"], target, tmp_path / "target", g, [[(0, 6)]])
    layout.manifest("capture").write_text(json.dumps({"complete": True, "output_id": "c1", "outputs": {
        "store": {k: str(s / "store.json") for k, s in stores.items()}}}))
    keep = torch.tensor(sorted(torch.randperm(V, generator=g)[:VD].tolist()))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    layout.prepare.vocab.parent.mkdir(parents=True)
    save_file({"d2t": keep - torch.arange(VD), "t2d": t2d}, str(layout.prepare.vocab))
    return layout, target


def test_capture_in_the_peers_offline_format(converted):
    layout, target, data = converted
    out = layout.root.parent / "peer"
    assert (data["train_rows"], data["eval_rows"], data["train_tokens"], data["eval_tokens"]) == (3, 1, 21, 6)
    assert int(4 * data["train_data_ratio"]) == 3  # the peer's validation split is exactly the eval rows
    assert data["argmax_agreement"] == 1.0 and data["target_layer_ids"] == [1, 2, 3]
    w, head = target["model.norm.weight"], target["lm_head.weight"]
    stored = {sid: t for sid, t in peer_store.read_store(layout.capture.store("train"))}
    stored[3] = next(t for _, t in peer_store.read_store(layout.capture.store("eval")))
    for i, s in stored.items():
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        T = len(s["input_ids"])
        assert hs["hidden_states"].shape == (T, N_AUX + 1, H) and hs["hidden_states"].dtype == torch.float32
        assert torch.equal(hs["token_ids"], s["input_ids"]) and hs["token_ids"].dtype == torch.int64
        assert torch.equal(hs["hidden_states"][:, :N_AUX].flatten(1), s["aux"].flatten(1))
        last = hs["hidden_states"][:, -1]  # what the peer's verifier_norm makes of it: the stored normed state, up to
        renormed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + EPS) * w  # its bf16's rms of ~1 +- 2**-8
        torch.testing.assert_close(renormed, s["normed"], rtol=1e-2, atol=1e-3)
        assert torch.equal(peer_store.peer_argmax(hs["hidden_states"], w, EPS, head), s["argmax"])
    assert torch.equal(load_file(data["heldout"])["3"], stored[3]["argmax"])
    vocab = load_file(str(layout.prepare.vocab))
    assert np.array_equal(np.load(data["d2t"]), vocab["d2t"].numpy()) and np.load(data["d2t"]).dtype == np.int64
    assert np.array_equal(np.load(data["t2d"]), vocab["t2d"].numpy()) and np.load(data["t2d"]).dtype == bool
    assert peer_store.convert_run(layout.root, out) == data  # a second run keeps the conversion


def test_the_peers_reader_takes_the_rows(converted):
    """What speculators/train/data.py ArrowDataset reads for row i: the Arrow row (torch format, as its preprocessing
    saves it) and, through hs_connectors' FileTransfer, hs_<i> with token ids equal to the row's."""
    from datasets import load_from_disk

    data = converted[2]
    code = ("import sys, pathlib, torch; from hs_connectors import FileTransfer; "
            "t = FileTransfer(pathlib.Path(sys.argv[1])); "
            "[torch.save(t.get_cached(i), f'{sys.argv[2]}/{i}.pt') for i in range(4)]")
    out = converted[0].root.parent / "read"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ORACLE)}
    done = subprocess.run([sys.executable, "-c", code, data["hidden_states"], str(out)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = load_from_disk(data["rows"])
    for i, T in enumerate((5, 9, 7, 6)):
        hs = torch.load(out / f"{i}.pt")
        assert torch.equal(hs["token_ids"], rows[i]["input_ids"]) and rows[i]["seq_len"] == T
        assert rows[i]["loss_mask"].shape == (T,) and rows[i]["loss_mask"].dtype == torch.int64
        # its split: hidden_states [T, 3H] (the aux states), verifier_last_hidden_states [T, H]
        assert hs["hidden_states"][:, :-1].flatten(1).shape == (T, N_AUX * H)
        assert hs["hidden_states"][:, -1].shape == (T, H)


def test_a_capture_without_a_held_out_store_is_refused(tmp_path):
    layout, _ = make_run(tmp_path)
    m = json.loads(layout.manifest("capture").read_text())
    del m["outputs"]["store"]["eval"]
    layout.manifest("capture").write_text(json.dumps(m))
    with pytest.raises(peer_store.StoreError, match="no eval store"):
        peer_store.convert_run(layout.root, tmp_path / "peer")


def test_bad_input_is_one_line_with_exit_2(tmp_path, capsys):
    assert compare_peer.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such run directory; give --recipe" in err[0], err
    assert compare_peer.main([str(tmp_path), "--sets", "heldout", "mt_bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'heldout' is the run's own prompts" in err[0], err
    assert compare_peer.main([str(tmp_path)]) == 2  # a directory that is no run: its stages are not there
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "are not complete; give --recipe" in err[0], err


def test_the_peer_with_fledges_optimizer_takes_the_runs_optimizer():
    """peer_fledge_optim trains the peer with the run's optimizer: Muon at the run's settings for a Muon run (not AdamW
    under Fledge's name), AdamW for an AdamW run."""
    spec_ = importlib.util.spec_from_file_location("compare_peer_side", REPO / "scripts" / "compare_peer_side.py")
    side = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(side)
    optim = {"name": "muon", "lr": 1e-3, "muon_lr": None, "muon_momentum": 0.9, "muon_weight_decay": 0.05,
             "warmup_steps": 30, "schedule": "cosine", "grad_clip": 0.5, "betas": [0.9, 0.95], "weight_decay": 0.0,
             "min_lr_ratio": 0.0}
    data = {k: "x" for k in ("rows", "hidden_states", "d2t", "t2d")} | {
        "draft_vocab_size": VD, "target_layer_ids": [1, 2, 3], "train_data_ratio": 0.9}
    plan = {"out": "/tmp/p", "verifier": "t", "ttt_steps": 3, "total_seq_len": 64}

    def flags(o):
        argv = side.train_argv({**plan, "optim": compare_peer.fledges_optim(o)}, data, 10, 1, 43)
        return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--") and i + 1 < len(argv)}

    muon = flags(optim)
    assert muon["--seed"] == "43"
    assert muon["--optimizer"] == "muon" and float(muon["--muon-lr"]) == 1e-3  # null: train.optim.lr
    assert float(muon["--muon-momentum"]) == 0.9 and float(muon["--muon-weight-decay"]) == 0.05
    adamw = flags({**optim, "name": "adamw"})
    assert adamw["--optimizer"] == "adamw" and "--muon-lr" not in adamw
