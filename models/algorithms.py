"""Drafter algorithms: the registry ``drafter.algorithm`` picks from.

An entry names the drafter module a ``DrafterSpec`` of that algorithm builds and the speculative-decoding method
vLLM serves it with. The other layers key their part on the same name, one entry each, so that layers only point
down (tests/unit/serving/test_dflash_layout.py::test_every_algorithm_has_its_entry_in_each_layer holds them equal):

- conf/schema.py ``ALGORITHMS``: the names ``drafter.algorithm`` accepts (the schema cannot import this file);
- train/ttt_model.py ``OBJECTIVES``: the drafter built for training and its objective over the shared feature
  batch (DFlash's: train/losses/dflash.py);
- serving/layouts.py ``LAYOUTS``: the export layout, its lint, loading, vLLM speculative config and card
  (DFlash's: serving/dflash_layout.py); EAGLE's is the default path through serving/dialects.py;
- the in-process proposer and held-out accuracy follow ``block`` below (evaluation/speculative.py).

Registered: ``eagle`` (models/drafter.py: EAGLE-3 and EAGLE-3.1 by their flags, P-EAGLE with ``parallel_drafting``,
all served by vLLM's ``eagle3`` method) and ``dflash`` (models/dflash.py, vLLM's ``dflash``).
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
    target_head: bool = False  # scores with the target's lm_head (loaded from the target, not the export)


ALGORITHMS: Registry[Algorithm] = Registry("drafter.algorithm", "models/algorithms.py")
ALGORITHMS.register("eagle", Algorithm("eagle", lambda spec, attention="auto", norm_impl="torch": Eagle3Drafter(
    spec, attention=attention, norm_impl=norm_impl), "eagle3", block=False))
ALGORITHMS.register("dflash", Algorithm("dflash", lambda spec, attention="auto", norm_impl="torch": DFlashDrafter(
    spec, norm_impl=norm_impl), "dflash", block=True, target_head=True))


def algorithm_of(spec: DrafterSpec) -> Algorithm:
    return ALGORITHMS.get(spec.algorithm)


def build_drafter(spec: DrafterSpec, attention: str = "auto", norm_impl: str = "torch") -> nn.Module:
    """The drafter module of ``spec``'s algorithm."""
    return algorithm_of(spec).build(spec, attention=attention, norm_impl=norm_impl)
