"""Export a trained drafter to a serving directory, and load one (ours or a public EAGLE-3) back.

The drafter's state_dict already uses the HF/EAGLE serving names (docs/serving.md, The export), so the adapters are
small: a dialect (serving/dialects.py) renames the layer prefix (``midlayer.`` <-> ``layers.0.`` for
speculators); floats go to bf16 while ``d2t`` (int64) and ``t2d`` (bool) keep their dtypes;
``embed_tokens.weight`` (a frozen copy of the target's) is left out unless asked for, since both engines
share the target's embedding. Weights are read through models/weights.py.

Export reads a drafter checkpoint and writes next to config.json its training record (both
models/drafter_checkpoint.py): the DrafterSpec and the flags the drafter was *trained* with, the step, metrics
and target. The linter compares config.json with it, which is the only way to catch a config whose
``norm_output`` disagrees with training from files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from fledge.atomic import atomic_path, read_json, write_json_atomic
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter import Eagle3Drafter
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.models.drafter_module import t2d_of
from fledge.models.families import read_target, text_config_dict
from fledge.models.layers.kind import get_layer_kind, kind_of_architecture, kind_of_config
from fledge.models.weights import load_input_embeddings, read_tensors
from fledge.serving.dialects import DIALECTS, dialect_of, get_dialect
from fledge.serving.layouts import layout_for, layout_of
from fledge.serving.serving_config import layer_config, parallel_drafting, serving_config

log = logging.getLogger(__name__)
_KEEP_DTYPE = ("d2t", "t2d")


def to_serving_state_dict(state_dict: dict[str, torch.Tensor], fmt: str = "hf",
                          include_embed: bool = False) -> dict[str, torch.Tensor]:
    """Drafter state_dict -> serving tensors: bf16 floats, maps as int64/bool, dialect ``fmt``'s names."""
    dialect = get_dialect(fmt)
    out = {}
    for name, t in state_dict.items():
        if name == "embed_tokens.weight" and not include_embed:
            continue
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif t.is_floating_point():
            t = t.to(torch.bfloat16)
        out[dialect.to_serving_name(name)] = t.detach().cpu().contiguous()
    return out


def from_serving_state_dict(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                            fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Serving tensors -> drafter state_dict names, floats cast to ``dtype``. ``fmt`` names the dialect;
    None accepts the layer prefix of any registered dialect."""
    dialects = [get_dialect(fmt)] if fmt else list(DIALECTS.values())
    out = {}
    for name, t in tensors.items():
        if name.startswith("model."):  # some public checkpoints keep the module prefix
            name = name[len("model."):]
        for d in dialects:
            back = d.from_serving_name(name)
            if back != name:
                name = back
                break
        out[name] = t.to(dtype) if t.is_floating_point() and name not in _KEEP_DTYPE else t
    return out


def write_drafter(out_dir: str | Path, state_dict: dict[str, torch.Tensor], config: dict,
                  trained: DrafterCheckpoint | None = None, max_shard_size: str | int = "5GB",
                  include_embed: bool = False) -> Path:
    """Write a serving directory atomically (temp dir + rename): config.json, safetensors (sharded with
    ``model.safetensors.index.json`` above ``max_shard_size``), and the training record of ``trained``."""
    from huggingface_hub import save_torch_state_dict

    tensors = to_serving_state_dict(state_dict, dialect_of(config).name, include_embed)
    out = Path(out_dir)
    with atomic_path(out, "export") as tmp:  # an existing out only when Fledge wrote it (fledge/owned.py)
        tmp.mkdir(parents=True)
        save_torch_state_dict(tensors, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        if trained is not None:
            trained.write_record(tmp)
    return out


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, target_config: Any, fmt: str = "hf",
                      max_shard_size: str | int = "5GB", target_name: str | None = None,
                      speculative_tokens: int = 5, include_embed: bool = False) -> dict:
    """A drafter checkpoint dir (models/drafter_checkpoint.py) -> a serving dir; returns the config written.
    The layout comes from the target's config and the spec's flags, never from the weights."""
    try:
        trained = DrafterCheckpoint.read(checkpoint_dir)
    except ValueError as e:
        raise ValueError(f"{e}; set export.checkpoint to best, last or such a directory") from None
    spec = trained.spec
    config = serving_config(target_config, spec, spec.aux_layer_ids, spec.draft_vocab_size, fmt=fmt,
                            target_name=target_name or trained.target.get("name_or_path"),
                            speculative_tokens=speculative_tokens)
    tensors = DrafterCheckpoint.tensors(checkpoint_dir)
    layout = layout_for(spec)
    if layout is not None:  # not EAGLE's: its own tensors (DFlash: the target's embedding and head stay out)
        tensors = layout.serving_tensors(tensors)
    write_drafter(out_dir, tensors, config, trained, max_shard_size, include_embed)
    return config


# ----------------------------------------------------------------------------------------------- loading


def spec_from_export(drafter_dir: str | Path, target_num_hidden_layers: int | None = None, serving: bool = False):
    """The DrafterSpec of an exported dir: from our training record when present, else (public EAGLE-3
    checkpoints) from config.json, read as the target's layer settings plus the Eagle-3 fields.
    ``serving``: from config.json even when the record is there, as vLLM and SGLang build it."""

    d = Path(drafter_dir)
    trained = None if serving else DrafterCheckpoint.record_spec(DrafterCheckpoint.read_record(d))
    if trained is not None:
        return trained
    config = read_json(d / "config.json")
    if config is None:
        raise ValueError(f"{d}: no config.json")
    layout = layout_of(config)
    if layout is not None:
        return layout.spec_from_config(config, target_num_hidden_layers)
    c = layer_config(config)
    hf = dict(c)
    hf["hidden_size"] = int(c.get("target_hidden_size") or c["hidden_size"])
    kind = kind_of_config(c)
    if kind is None:  # public checkpoints: LlamaForCausalLMEagle3 with an odd model_type
        kind = kind_of_architecture(config.get("architectures") or []) or get_layer_kind("llama")
    flags = _Flags(fc_norm=bool(c.get("fc_norm")), norm_output=bool(c.get("norm_output")),
                   norm_before_fc=bool(c.get("norm_before_fc")),
                   draft_vocab_size=int(c.get("draft_vocab_size") or c["vocab_size"]), layer=kind.name,
                   parallel_drafting=parallel_drafting(config), mask_token_id=c.get("mask_token_id"))
    ids = c.get("aux_layer_ids")
    if not ids:
        raise ValueError(f"{d}/config.json has no eagle_aux_hidden_state_layer_ids; add the boundary ids the "
                         "drafter was trained with (default (2, L//2, L-3) of the target)")
    # The serving config says num_hidden_layers=1 (the drafter's); the spec wants the target's L, which only
    # bounds the aux ids: without the target, the smallest L that admits them. The layer settings are read
    # back as a Llama-shaped target config would be, the layer kind's own keys (MLA widths) included.
    hf["num_hidden_layers"] = int(target_num_hidden_layers or c.get("target_num_hidden_layers") or max(ids) + 1)
    hf["model_type"] = "llama"
    spec = DrafterSpec.from_target_config(hf, flags, list(ids))
    if int(c["hidden_size"]) != hf["hidden_size"]:  # a drafter narrower than its target
        spec = dataclasses.replace(spec, hidden_size=int(c["hidden_size"]),
                                   intermediate_size=int(c["intermediate_size"]))
    return spec


@dataclasses.dataclass
class _Flags:
    """The DrafterConfig fields from_target_config reads, for checkpoints without a training record."""

    fc_norm: bool
    norm_output: bool
    norm_before_fc: bool
    draft_vocab_size: int
    aux_layer_ids: list | None = None
    layer: str = "llama"
    parallel_drafting: bool = False  # P-EAGLE: config.json names a mask_token_id
    mask_token_id: int | None = None


def load_drafter(drafter_dir: str | Path, embed_weight: torch.Tensor | None = None,
                 target: str | Path | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", serving: bool = False, spec: DrafterSpec | None = None,
                 head_weight: torch.Tensor | None = None):
    """Read an exported dir (any dialect, or a public EAGLE-3 checkpoint in the HF layout) into an
    ``Eagle3Drafter``, or a DFlash export into a ``DFlashDrafter``. When the export has no
    ``embed_tokens.weight``, it comes from ``embed_weight`` or from the target's safetensors (``target`` = a local
    dir); a missing ``t2d`` is rebuilt from ``d2t``; a DFlash drafter's missing ``lm_head.weight`` (the target's)
    from ``head_weight`` or the target's safetensors.
    ``serving``: the drafter config.json and the weights describe, as an engine loads it (the training
    record ignored), for measuring what is served; else the record's spec when there is one. ``spec``: that
    spec, already read by :func:`spec_from_export` (the caller's, so it is built once)."""

    d = Path(drafter_dir)
    if spec is None:
        L = None
        if target is not None and (Path(target) / "config.json").exists():
            L = read_target(read_json(Path(target) / "config.json"))[1].num_hidden_layers
        spec = spec_from_export(d, L, serving=serving)
    layout = layout_for(spec)
    if layout is not None:
        return layout.load(d, spec, embed_weight, head_weight, target, dtype).to(device)
    sd = from_serving_state_dict(read_tensors(d), dtype, dialect_of(read_json(d / "config.json") or {}).name)
    V, Vd = spec.vocab_size, spec.draft_vocab_size
    if "embed_tokens.weight" not in sd:
        if embed_weight is None and target is not None:
            embed_weight = load_input_embeddings(target)
        if embed_weight is None:
            raise ValueError(f"{d} has no embed_tokens.weight: pass the target (embed_weight= or target=)")
        sd["embed_tokens.weight"] = embed_weight.to(dtype)
    if "d2t" not in sd:
        if Vd != V:
            raise ValueError(f"{d}: draft_vocab_size={Vd} < vocab_size={V} but no d2t tensor")
        sd["d2t"] = torch.zeros(Vd, dtype=torch.int64)
    if "t2d" not in sd:  # engines ignore it; rebuild it from d2t (docs/architecture.md, The draft vocabulary)
        sd["t2d"] = t2d_of(sd["d2t"], V)
    model = Eagle3Drafter(spec)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{d}: tensors do not match the drafter (missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}); run `fledge lint` on it")
    return model.to(device)


# ------------------------------------------------------------------------------------------ the stage


def load_target_config(target_cfg) -> dict:
    """The target's config.json as a dict: a local dir's file, else ``target.config_overrides`` (recipes
    write it so export works offline), else ``AutoConfig.from_pretrained`` (hub)."""
    p = Path(target_cfg.name_or_path)
    if (p / "config.json").exists():
        return text_config_dict(json.loads((p / "config.json").read_text()))
    if target_cfg.config_overrides:
        return text_config_dict(dict(target_cfg.config_overrides))
    from transformers import AutoConfig

    return text_config_dict(AutoConfig.from_pretrained(
        target_cfg.name_or_path, revision=target_cfg.revision, trust_remote_code=target_cfg.trust_remote_code))
