"""Drafter algorithms: the registry ``drafter.algorithm`` picks from.

An entry names the drafter module a ``DrafterSpec`` of that algorithm builds and the speculative-decoding method
vLLM serves it with. The other layers key their part on the same name, each in its own package, so that layers only
point down:

- the training objective over the shared feature batch: train/losses/<name>.py, built by train/ttt_model.py;
- the export layout, its lint and vLLM speculative config: serving/<name>_layout.py (DFlash's), dispatched from
  serving/serving_config.py, export.py, lint.py, engine.py and card.py;
- the in-process proposer and held-out accuracy: evaluation/speculative.py (``proposer_for``), evaluate.py.

Registered: ``eagle`` (models/drafter.py: EAGLE-3 and EAGLE-3.1 by their flags, P-EAGLE with ``parallel_drafting``,
all served by vLLM's ``eagle3`` method) and ``dflash`` (models/dflash.py, vLLM's ``dflash``). A new algorithm is
an entry here, its model file, and its entries in those three places.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fledge.models.dflash import DFlashDrafter
from fledge.models.drafter import DrafterSpec, Eagle3Drafter
from fledge.registry import Registry


@dataclass(frozen=True)
class Algorithm:
    name: str
    build: Callable[..., nn.Module]  # (spec, attention=..., norm_impl=...) -> the drafter module
    vllm_method: str  # vLLM's speculative_config "method"
    block: bool  # drafts all k tokens in one forward without feeding a draft back (the proposer's loop)


ALGORITHMS: Registry[Algorithm] = Registry("drafter.algorithm", "models/algorithms.py")
ALGORITHMS.register("eagle", Algorithm("eagle", lambda spec, attention="auto", norm_impl="torch": Eagle3Drafter(
    spec, attention=attention, norm_impl=norm_impl), "eagle3", block=False))
ALGORITHMS.register("dflash", Algorithm("dflash", lambda spec, attention="auto", norm_impl="torch": DFlashDrafter(
    spec, norm_impl=norm_impl), "dflash", block=True))


def algorithm_of(spec: DrafterSpec) -> Algorithm:
    return ALGORITHMS.get(spec.algorithm)


def build_drafter(spec: DrafterSpec, attention: str = "auto", norm_impl: str = "torch") -> nn.Module:
    """The drafter module of ``spec``'s algorithm."""
    return algorithm_of(spec).build(spec, attention=attention, norm_impl=norm_impl)
