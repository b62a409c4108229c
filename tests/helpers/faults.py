"""Planted silent serving faults: an export that loads in vLLM without complaint but is served wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _config(d: Path, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _shift_aux(cfg: dict) -> None:  # every aux layer id one deeper (the off-by-one of SGLang's +1 convention)
    ec = cfg["eagle_config"]
    ec["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]]


def _flip_norm_output(cfg: dict) -> None:  # EAGLE-3.1 trained, EAGLE-3 feedback served
    cfg["norm_output"] = not cfg["norm_output"]


def _d2t_off_by_one(d: Path) -> None:  # every draft id maps to the target id after the right one
    path = next(d.glob("*.safetensors"))
    sd = load_file(str(path))
    sd["d2t"] = sd["d2t"] + torch.ones_like(sd["d2t"])
    save_file(sd, str(path), metadata={"format": "pt"})


FAULTS = {"aux_ids_shifted": lambda d: _config(d, _shift_aux),
          "norm_output_flipped": lambda d: _config(d, _flip_norm_output),
          "d2t_off_by_one": _d2t_off_by_one}


def plant(export: Path, fault: str, out: Path) -> Path:
    """A copy of the HF-dialect ``export`` in ``out`` with ``fault`` planted; the training record stays."""
    shutil.copytree(export, out)
    FAULTS[fault](out)
    return out
