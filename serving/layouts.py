"""Serving layouts: what serving does with an export, per drafter algorithm (models/algorithms.py).

EAGLE's drafters (``eagle``: EAGLE-3, EAGLE-3.1; ``peagle``: P-EAGLE) are the default path: their config.json comes
from an export dialect (serving/dialects.py) and export.py, lint.py, engine.py and card.py handle them directly. Any
other algorithm is one entry here: a module with the functions of :class:`Layout` (serving/dflash_layout.py is
``dflash``'s), which those files call through :func:`layout_for` (by the algorithm of a spec or config) and
:func:`layout_of` (by what an exported config.json is). A new algorithm's serving is its module plus its line below
(serving/dspark_layout.py, DSpark's, is DFlash's with vLLM's DSpark keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fledge.models.algorithms import DrafterSpec, algorithm_of
from fledge.registry import Registry
from fledge.serving import dflash_layout, dspark_layout, mtp_layout
from fledge.serving.export_reading import Finding


class Layout(Protocol):
    def owns(self, config: Mapping) -> bool:
        """Whether an exported config.json is this algorithm's."""

    def build_config(self, layer: dict, spec: Any, aux_layer_ids: list[int], target_hidden_size: int,
                     target_num_layers: int) -> dict:
        """config.json from the target's layer settings (``layer``, serving_config.py's) and the drafter's spec."""

    def serving_tensors(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The trained state_dict -> the tensors the export writes."""

    def spec_from_config(self, config: Mapping, target_num_hidden_layers: int | None = None) -> DrafterSpec:
        """The spec an exported config.json describes, as the engine builds it."""

    def lint(self, d: Path, config: Mapping, target_layers: int | None, record: dict | None) -> list[Finding]:
        """The layout's own findings (lint.py adds the checks against the target and the training record)."""

    def load(self, d: Path, spec: DrafterSpec, embed_weight, head_weight, target, dtype) -> nn.Module:
        """The drafter module of the export in ``d`` for the in-process harness."""

    def speculative_config(self, config: Mapping, model: str, k: int) -> dict:
        """vLLM's ``speculative_config`` serving the export whose config.json is ``config`` from ``model`` (a path
        or hub id) with ``k`` speculative tokens (serving_config.py's ``vllm_speculative_config`` calls it)."""

    def card(self, config: Mapping, record: dict, repo_id: str, served: dict) -> tuple[list[str], list[str]]:
        """The model card's own sections (card.py adds the measured ones) and its tags; ``served`` is the
        ``speculative_config`` its command must carry (``vllm_speculative_config``'s, as the eval sends it)."""


# EAGLE's algorithms are reserved: valid names without an entry, served by the dialects
LAYOUTS: Registry[Layout] = Registry("drafter.algorithm", "serving/layouts.py", reserved=("eagle", "peagle"))
# dspark first: layout_of takes the first owner, and a DSpark config may carry the dflash_config dflash_layout owns
LAYOUTS.register("dspark", dspark_layout)
LAYOUTS.register("dflash", dflash_layout)
LAYOUTS.register("mtp", mtp_layout)


def layout_for(drafter: Any) -> Layout | None:
    """The layout of a spec's or a config's algorithm (models/algorithms.py ``algorithm_of``); None for EAGLE's (the
    dialects' path)."""
    name = algorithm_of(drafter).name
    return LAYOUTS.get(name) if name in LAYOUTS else None


def layout_of(config: Mapping) -> Layout | None:
    """The layout an exported config.json is written in; None for an EAGLE export."""
    return next((layout for layout in LAYOUTS.values() if layout.owns(config)), None)
