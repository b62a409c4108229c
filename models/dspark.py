"""The DSpark block drafter, as vLLM 0.32 serves it (``method="dspark"``, ``Qwen3DSparkForCausalLM``): DFlash
(models/dflash.py) plus two changes, each a hook of ``DFlashDrafter``.

- The anchor drafts (``anchor_drafts``, vLLM's and speculators' ``sample_from_anchor``): a block is ``[bonus token,
  mask, ..., mask]`` of ``block_size`` tokens at positions P..P+B-1, and slot j predicts the token at P+1+j, so a
  block of B drafts B tokens (DFlash's anchor slot drafts nothing: B - 1). vLLM drafts exactly
  ``num_speculative_tokens`` slots, so a DSpark drafter is served with ``num_speculative_tokens = block_size``.
- A Markov head (``markov_head``): a low-rank bias ``markov_w2(markov_w1[prev])`` added to slot j's logits, where
  ``prev`` is the token just before the one slot j predicts (the anchor for slot 0, then the token slot j - 1 chose).
  Drafting is therefore sequential over the block's slots after one parallel forward (``propose``); training feeds the
  data's tokens as ``prev`` (teacher forcing), as speculators' DSpark trainer does.

Both tensors are exported under vLLM's names (``markov_head.markov_w1.weight [V, r]``: the previous token is a target
id; ``markov_head.markov_w2.weight [Vd, r]``: a bias over the draft vocab); the drafter drafts over DFlash's draft
vocab with the target's frozen lm_head rows, as DFlash does.
speculators' confidence head (a per-slot acceptance estimate vLLM reads only for adaptive verification) is not
trained: vLLM drafts the same tokens without it.

``DSparkSpec`` is its spec (DFlash's fields and ``markov_rank``); the module registers the algorithm ``dspark``
(vLLM's ``dspark`` method, which vLLM 0.32 runs only in its V2 GPU model runner: ``vllm_cpu=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fledge.models.dflash import DFlashDrafter, DFlashSpec
from fledge.models.spec import ALGORITHMS, Algorithm, check_mask_token, option

MARKOV_RANK = 256  # speculators 0.9.0's DSpark default (its DSpark config module)


@dataclass
class DSparkSpec(DFlashSpec):
    """A DSpark drafter: a DFlash one whose anchor drafts, with a Markov head of rank ``markov_rank``."""

    algorithm: ClassVar[str] = "dspark"

    block_size: int = 8  # speculators' DSpark default: 8 tokens drafted per block
    markov_rank: int = MARKOV_RANK

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {**super().config_fields(drafter, hf_config, vocab_size),
                "markov_rank": int(option(drafter, "markov_rank", MARKOV_RANK))}

    def _validate_own(self) -> None:
        check_mask_token(self, "a DSpark block is filled with")
        if self.block_size < 2 or self.num_draft_layers < 1 or self.markov_rank < 1 \
                or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"a DSpark spec needs block_size >= 2 (has {self.block_size}), num_draft_layers >= 1 "
                             f"(has {self.num_draft_layers}), markov_rank >= 1 (has {self.markov_rank}) and 1 <= "
                             f"draft_vocab_size <= vocab_size (has {self.draft_vocab_size}, {self.vocab_size})")


class MarkovHead(nn.Module):
    """The sequential bias ``markov_w2(markov_w1[prev])`` ``[..., Vd]`` of a previous target id: a rank-r
    factorisation of a V x Vd transition table (speculators' vanilla ``MarkovHead``; vLLM's ``DSparkMarkovHead``).
    Initialised as speculators does: w1 N(0, 0.01), w2 nn.Linear's default."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter of a ``DSparkSpec``: DFlash's backbone, the anchor drafting, the Markov head."""

    anchor_drafts: ClassVar[bool] = True

    def __init__(self, spec: DSparkSpec, norm_impl: str = "torch") -> None:
        if not isinstance(spec, DSparkSpec):
            raise ValueError(f"DSparkDrafter needs a dspark spec, got algorithm={spec.algorithm!r}")
        super().__init__(spec, norm_impl=norm_impl)
        self.markov_head = MarkovHead(spec.vocab_size, spec.markov_rank, spec.draft_vocab_size)

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h) + self.markov_head(prev).to(h.dtype)

    def head_input(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, self.markov_head.markov_w1(prev).to(h.dtype)], -1)

    def head_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        return torch.cat([lm_head, self.markov_head.markov_w2.weight.to(lm_head.dtype)], 1)

    def propose(self, bonus: torch.Tensor, position: torch.Tensor, ctx_kv, k: int,
                pick=lambda logits: logits.argmax(-1)) -> tuple[torch.Tensor, torch.Tensor]:
        """One block as vLLM's ``DSparkSpeculator`` drafts it: one forward over ``bonus`` and k - 1 masks, then the
        slots in order, each slot's logits biased by the target id ``pick`` chose before it (the anchor for the
        first)."""
        ids, pos = self.block_inputs(bonus, position, k)
        base = self.lm_head(self.blocks(ids, pos, ctx_kv, None))
        prev, tokens, logits = bonus, [], []
        for j in range(k):
            logits.append(base[:, j] + self.markov_head(prev).to(base.dtype))
            prev = self.draft_to_target(pick(logits[-1]))
            tokens.append(prev)
        return torch.stack(tokens, 1), torch.stack(logits, 1)


def _build(spec: DSparkSpec, attention: str = "auto", norm_impl: str = "torch") -> DSparkDrafter:
    return DSparkDrafter(spec, norm_impl=norm_impl)  # a block attends with plain SDPA: no attention choice


ALGORITHMS.register("dspark", Algorithm("dspark", DSparkSpec, _build, vllm_method="dspark", block=True,
                                        target_head=True, vllm_cpu=False, title="DSpark",
                                        rounds="a block of k={k} drafts in one drafter forward"))
