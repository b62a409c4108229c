"""Drafter layer kinds: the record each kind fills in, and the registry ``drafter.layer`` picks from.

``drafter.layer`` picks one: ``auto`` (the target family's ``layer_kind``, models/families.py), ``llama``,
``qwen3`` or ``mla``. Everything else of the layer (the 2H input ``[input_layernorm(emb), hidden_norm(g)]``,
the residual around the raw g, the dense SiLU MLP, the EAGLE-3.1 flags, the TTT unroll and both attention
paths of models/attention.py) is shared; a kind owns its attention module, the config.json keys and
``architectures`` vLLM builds it from, its tensor names and shapes, its lint checks, whether the
speculators format can carry it, and every other way it differs (the RoPE width, the attention backend it
needs on a CPU engine, what it warns about a target): those are fields of its :class:`LayerKind`, so no
code outside the kind's own file names it. The spec is vLLM 0.32's model code (each kind's file says which).

Adding a kind: a file beside this one with an attention module (``project(z, cos, sin) -> q, k, v`` and
``output(a) -> [B, T, H]``) and a ``LayerKind`` registered in :data:`LAYER_KINDS`, imported by
models/layers/__init__.py, and its tests (tests/unit/models/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from fledge.registry import Registry

Finding = tuple[str, str, str, str]  # (level, code, message, fix), as serving/lint.py reports them


def _no_keys(layer: dict, target: Mapping) -> dict:
    return {}


def _no_findings(config: Mapping) -> list[Finding]:
    return []


def _no_target_findings(config: Mapping, target: Mapping) -> list[Finding]:
    return []


def _head_dim(spec) -> int:
    return spec.head_dim


@dataclass(frozen=True)
class LayerKind:
    """One drafter layer kind. ``settings(layer, target)`` gives the config.json keys the kind adds to the
    Llama-shaped layer settings (``layer``: families.py's drafter_layer; ``target``: the target's text config
    dict); ``spec_keys`` are those the DrafterSpec carries; ``tensors(config, prefix, H)`` the attention
    tensors' shapes; ``checks(config)`` the linter's findings on the layer's own keys, ``target_checks(config,
    target)`` those against the target's text config; ``speculators``: whether the speculators format (and
    vLLM's adapter of it) has this layer; ``rope_dim(spec)`` the width RoPE rotates; ``cpu_attention_backend``
    the vLLM attention backend this attention needs on a CPU engine (None: vLLM's own choice)."""

    name: str
    model_type: str  # config.json's model_type: the transformers config vLLM builds the layer from
    architecture: str  # what the hf dialect writes in config.json's architectures
    attention: Callable[[Any], nn.Module]
    tensors: Callable[[Mapping, str, int], dict[str, tuple[int, ...]]]
    settings: Callable[[dict, Mapping], dict] = _no_keys
    spec_keys: tuple[str, ...] = ()
    checks: Callable[[Mapping], list[Finding]] = _no_findings
    target_checks: Callable[[Mapping, Mapping], list[Finding]] = _no_target_findings
    speculators: bool = True
    aliases: tuple[str, ...] = ()  # other architectures names vLLM maps to the same class
    rope_dim: Callable[[Any], int] = _head_dim
    cpu_attention_backend: str | None = None


LAYER_KINDS: Registry[LayerKind] = Registry("drafter.layer", "models/layers/ (a file per kind)", reserved=("auto",))
# What a drafter config.json without a known model_type is read as (public EAGLE-3 checkpoints): the Llama
# layer, EAGLE-3's own (models/layers/llama.py).
DEFAULT_KIND = "llama"


def register_layer_kind(kind: LayerKind, replace: bool = False) -> LayerKind:
    return LAYER_KINDS.register(kind.name, kind, replace=replace)


def get_layer_kind(name: str) -> LayerKind:
    return LAYER_KINDS.get(name)


def resolve_layer_kind(requested: str | None, family_kind: str) -> LayerKind:
    """``drafter.layer``: auto (or absent) -> the target family's layer kind."""
    return get_layer_kind(family_kind if requested in (None, "", "auto") else requested)


def check_layer_format(layer: str, fmt: str) -> None:
    """``drafter.layer`` names a kind (or auto), and an explicit kind the speculators format lacks is refused
    before any stage runs (an auto kind is checked at export, where the target is known)."""
    if layer in (None, "", "auto"):
        return
    kind = get_layer_kind(layer)
    if fmt == "speculators" and not kind.speculators:
        raise ValueError(f"drafter.layer={layer} with export.format=speculators: the speculators format has no "
                         f"{layer!r} layer (speculators 0.9.0 builds llama and qwen3 only); use export.format=hf")


def layer_settings(kind: LayerKind, layer: dict, target: Mapping) -> dict:
    """The kind's config.json keys: the Llama-shaped ``layer`` with the kind's model_type and own keys."""
    return {**layer, "model_type": kind.model_type, **kind.settings(layer, target)}


def kind_of_config(c: Mapping) -> LayerKind | None:
    """The kind a drafter layer's config keys describe (by ``model_type``), None when no kind has it."""
    for kind in LAYER_KINDS.values():
        if c.get("model_type") == kind.model_type:
            return kind
    return None


def kind_of_architecture(archs) -> LayerKind | None:
    for kind in LAYER_KINDS.values():
        if kind.architecture in archs or any(a in archs for a in kind.aliases):
            return kind
    return None
