"""P-EAGLE, the parallel EAGLE drafter: the spec (``PEagleSpec``) and the algorithm ``peagle``.

An EAGLE-3.1 drafter (models/eagle.py) whose draft steps after the first take ``mask_token_id`` and a learned state
(``Eagle3Drafter.mask_hidden``, in the aux states' space) instead of the draft before them, so the engine proposes
all k tokens in one forward. vLLM serves it with its ``eagle3`` method and ``parallel_drafting``
(serving/serving_config.py). A config selects it with ``drafter.algorithm=eagle`` and
``drafter.parallel_drafting=true`` (conf/drafter/p_eagle.yaml): the keys users have always written, so run hashes
and checkpoints stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fledge.models.drafter import Eagle3Drafter
from fledge.models.eagle import EagleSpec
from fledge.models.spec import ALGORITHMS, Algorithm, check_mask_token, mask_token_id_for


@dataclass
class PEagleSpec(EagleSpec):
    """A P-EAGLE drafter: an EAGLE one whose parallel slots are fed ``mask_token_id`` (a target-vocab id)."""

    parallel_drafting: ClassVar[bool] = True

    mask_token_id: int | None = None

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {**super().config_fields(drafter, hf_config, vocab_size),
                "mask_token_id": mask_token_id_for(drafter, hf_config, vocab_size)}

    def _validate_own(self) -> None:
        check_mask_token(self, "parallel drafting feeds its slots")


ALGORITHMS.register("peagle", Algorithm("peagle", PEagleSpec, Eagle3Drafter, vllm_method="eagle3", block=False,
                                        title="P-EAGLE", rounds="k={k} parallel drafts in one drafter forward"))
