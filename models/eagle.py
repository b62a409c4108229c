"""EAGLE-3 and EAGLE-3.1, the chain drafters: the spec (``EagleSpec``) and the algorithm ``eagle``.

The drafter is models/drafter.py's ``Eagle3Drafter``: one layer whose output state is fed back, one draft token per
forward; EAGLE-3.1 is EAGLE-3 with two flags on, ``fc_norm`` (an RMSNorm per aux state before ``fc``) and
``norm_output`` (the normed state fed back). vLLM serves it with its ``eagle3`` method. A config selects it with
``drafter.algorithm=eagle`` and ``drafter.parallel_drafting=false`` (P-EAGLE, the parallel one: models/peagle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fledge.models.drafter import Eagle3Drafter
from fledge.models.spec import ALGORITHMS, Algorithm, DrafterSpec, option


@dataclass
class EagleSpec(DrafterSpec):
    """An EAGLE-3 (flags off) / EAGLE-3.1 (``fc_norm`` + ``norm_output``) chain drafter."""

    algorithm: ClassVar[str] = "eagle"

    fc_norm: bool = True
    norm_output: bool = True
    norm_before_fc: bool = False

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {**super().config_fields(drafter, hf_config, vocab_size),
                **{k: option(drafter, k) for k in ("fc_norm", "norm_output", "norm_before_fc")}}

    def _flag_rules(self) -> dict[str, bool]:
        return {"fc_norm": self.fc_norm, "norm_before_fc": self.norm_before_fc}


ALGORITHMS.register("eagle", Algorithm("eagle", EagleSpec, Eagle3Drafter, vllm_method="eagle3", block=False))
