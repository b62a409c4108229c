"""Drafter algorithms: the registry ``drafter.algorithm`` (with ``drafter.parallel_drafting``) picks from.

An algorithm is one module per layer, each registering its part under the algorithm's name in that layer's registry
(tests/unit/serving/test_dflash_layout.py::test_every_algorithm_has_its_entry_in_each_layer holds them equal):

- models: the module with its spec class (models/spec.py's ``DrafterSpec`` and its fields) and its ``Algorithm``,
  the drafter module it builds and the speculative-decoding method vLLM serves it with, registered in ``ALGORITHMS``
  (models/spec.py); importing this file imports every one;
- conf/schema.py ``ALGORITHMS``: the ``drafter.algorithm`` values the config accepts (the schema cannot import this
  file) and their config rules;
- train/objectives/ ``OBJECTIVES``: the drafter built for training and its objective over the shared feature
  batch, a module per algorithm (train/objectives/eagle.py, train/objectives/dflash.py);
- serving/layouts.py ``LAYOUTS``: the export layout, its lint, loading, vLLM speculative config and card
  (DFlash's: serving/dflash_layout.py); EAGLE's and P-EAGLE's are the default path through serving/dialects.py;
- the in-process proposer and held-out accuracy follow ``Algorithm.block`` (evaluation/speculative.py).

Registered: ``eagle`` (models/eagle.py: EAGLE-3 and EAGLE-3.1 by their flags), ``peagle`` (models/peagle.py:
P-EAGLE, ``drafter.parallel_drafting``), both models/drafter.py's ``Eagle3Drafter`` served by vLLM's ``eagle3``
method, ``dflash`` (models/dflash.py, vLLM's ``dflash``) and ``dspark`` (models/dspark.py: DFlash whose anchor
drafts, plus a Markov head; vLLM's ``dspark``). :func:`algorithm_of` finds the entry of a spec, a
config or a spec's JSON; code outside an algorithm's modules asks its entry, never its name.

``mtp`` (models/mtp_drafter.py) is the target's own MTP module (models/mtp.py) as a chain drafter, served by vLLM's
``mtp`` method.
"""

from __future__ import annotations

from torch import nn

from fledge.models import dflash, dspark, eagle, mtp_drafter, peagle  # noqa: F401 (each registers its algorithm)
from fledge.models.spec import ALGORITHMS, DEFAULT_ALGORITHM, Algorithm, DrafterSpec, algorithm_of, mask_token_id_for

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Algorithm", "DrafterSpec", "algorithm_of", "build_drafter",
           "mask_token_id_for"]


def build_drafter(spec: DrafterSpec, attention: str = "auto", norm_impl: str = "torch") -> nn.Module:
    """The drafter module of ``spec``'s algorithm."""
    return algorithm_of(spec).build(spec, attention=attention, norm_impl=norm_impl)
