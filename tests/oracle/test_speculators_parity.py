"""Parity with an independent implementation: vLLM's `speculators` (SPEC.md section 9).

A Fledge drafter exported in the speculators dialect must load into speculators 0.9.0's own
Eagle3DraftModel with no missing or unexpected tensor (this checks the dialect's names, `fc_norm.*`
included, and its config flags), and speculators' TTT forward must give the same logits as Fledge's at
every step (the fused features, fc_norm, the 2H attention input, the step-k masks and positions, and
norm_output feedback). EAGLE-3 (flags off) and EAGLE-3.1 (flags on) both.

speculators pins transformers <= 5.19, so it lives apart from the project's environment: install it with
`bash scripts/setup_oracle.sh` (into .oracle/site; scripts/test.sh does this) and the speculators side runs
in a subprocess with that directory first on its path. Without it these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("FLEDGE_ORACLE_SITE", REPO / ".oracle" / "site"))
STEPS = 4

pytestmark = pytest.mark.skipif(not (SITE / "speculators").is_dir(),
                                reason=f"no speculators oracle at {SITE} (bash scripts/setup_oracle.sh)")


def _inputs(target_cfg: dict, n_aux: int, T: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """One packed row of two documents (14 + 10 tokens), Fledge's unshifted layout."""
    g = torch.Generator().manual_seed(seed)
    H, V = target_cfg["hidden_size"], target_cfg["vocab_size"]
    doc = torch.tensor([[0] * 14 + [1] * (T - 14)], dtype=torch.int32)
    pos = torch.cat([torch.arange(14), torch.arange(T - 14)])[None]
    return {"input_ids": torch.randint(0, V, (1, T), generator=g), "aux_hidden": torch.randn(1, T, n_aux * H, generator=g),
            "position_ids": pos, "document_ids": doc}


def _fledge_logits(drafter_dir: Path, x: dict) -> list[torch.Tensor]:
    from data.batch import FeatureBatch
    from models.export import load_drafter
    from train.loss import ttt_states

    d = load_drafter(drafter_dir).eval()
    T = x["input_ids"].shape[1]
    batch = FeatureBatch(input_ids=x["input_ids"], loss_mask=torch.ones(1, T, dtype=torch.bool),
                         aux_hidden=x["aux_hidden"], target_hidden=torch.zeros(1, T, d.spec.target_hidden_size),
                         target_argmax=torch.zeros(1, T, dtype=torch.int64), position_ids=x["position_ids"],
                         document_ids=x["document_ids"])
    with torch.no_grad():
        return [d.lm_head(y) for y in ttt_states(d, batch, STEPS)]


def _speculators_logits(drafter_dir: Path, x: dict, tmp: Path) -> tuple[list[torch.Tensor], dict]:
    # speculators takes rows pre-shifted: row t holds x_{t+1} with A_t (Fledge's step-0 token).
    ids = torch.zeros_like(x["input_ids"])
    ids[:, :-1] = x["input_ids"][:, 1:]
    save_file({"input_ids": ids, "aux_hidden": x["aux_hidden"], "position_ids": x["position_ids"],
               "document_ids": x["document_ids"].long()}, tmp / "inputs.safetensors")
    env = dict(os.environ, PYTHONPATH=str(SITE), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "tests/oracle/speculators_side.py"), str(drafter_dir),
                           str(tmp / "inputs.safetensors"), str(tmp / "out.safetensors"), str(STEPS)],
                          env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with safe_open(tmp / "out.safetensors", "pt") as f:
        report = json.loads(f.metadata()["report"])
        return [f.get_tensor(f"logits_{k}") for k in range(STEPS)], report


@pytest.mark.parametrize("flags", [dict(fc_norm=True, norm_output=True), dict(fc_norm=False, norm_output=False)],
                         ids=["eagle3.1", "eagle3"])
def test_speculators_loads_the_export_and_computes_the_same_logits(flags, random_tiny_target, tmp_path):
    from models.export import random_state_dict, write_drafter
    from models.serving_config import serving_config

    target = Path(random_tiny_target)
    tcfg = json.loads((target / "config.json").read_text())
    L = tcfg["num_hidden_layers"]
    ids = [2, L // 2, L - 3]
    config = serving_config(tcfg, flags, ids, 512, fmt="speculators", target_name=str(target))
    sd = random_state_dict(config, seed=3)
    with torch.no_grad():  # norms near 1, so the logits are not dominated by one random scale
        for name, t in sd.items():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}":
                t.uniform_(0.5, 1.5)
    out = write_drafter(tmp_path / "drafter", sd, config, include_embed=True)

    x = _inputs(tcfg, len(ids))
    ours = _fledge_logits(out, x)
    theirs, report = _speculators_logits(out, x, tmp_path)

    assert report["unexpected"] == [] and report["mismatched"] == [], report
    assert set(report["missing"]) <= {"verifier_norm.weight", "verifier_lm_head.weight"}, report
    assert report["nan_params"] == [], report  # every tensor it uses came from the export
    assert report["aux_ids"] == ids
    assert report["flags"]["fc_norm"] == flags["fc_norm"] and report["flags"]["norm_output"] == flags["norm_output"]
    assert report["flags"]["norm_before_residual"] is False
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, (k, a.shape, b.shape)
        err = (a - b).abs().max().item()
        assert err < 1e-4 * max(1.0, b.abs().max().item()), f"step {k}: max |logit difference| {err:.3g}"
