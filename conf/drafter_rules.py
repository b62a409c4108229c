"""The rules a drafter's aux layer ids and flags obey, written once.

The config (``Config.validate``), the drafter (``DrafterSpec.validate``), the serving config builder and
the linter all check the same things; they call :func:`drafter_problems` and differ only in what they do
with a problem (raise, or report a lint finding with a fix). It lives here, in the schema layer, because
the config check may not import the model code while everything else may import the schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DrafterProblem:
    code: str  # stable id, also the linter's finding code ("aux-ids-order", ...)
    message: str  # names the config key and the offending value


def drafter_problems(aux_layer_ids: Optional[Sequence[int]] = None, num_hidden_layers: Optional[int] = None, *,
                     fc_norm: bool = False, norm_before_fc: bool = False,
                     ttt_steps: Optional[int] = None, draft_vocab_size: Optional[int] = None,
                     vocab_size: Optional[int] = None, prefix: str = "drafter.") -> list[DrafterProblem]:
    """Every broken rule among the values given (``None`` skips the rules about that value; the id range
    needs the target's ``num_hidden_layers``, the draft vocab's upper bound its ``vocab_size``).

    Aux ids use the boundary convention (docs/architecture.md, Aux layer ids): id i is the state after i layers, so 0 is
    the embedding and L the pre-norm output. Messages name the keys as ``prefix + field``
    ("drafter.aux_layer_ids" in the config, bare field names elsewhere)."""
    out: list[DrafterProblem] = []
    if aux_layer_ids is not None:
        out += _aux_id_problems([int(i) for i in aux_layer_ids], num_hidden_layers, prefix)
    if fc_norm and norm_before_fc:
        out.append(DrafterProblem("fc-norm-and-norm-before-fc", f"{prefix}fc_norm=true and {prefix}norm_before_fc="
                                  "true: pick one (EAGLE-3.1 uses fc_norm; the two exclude each other)"))
    if ttt_steps is not None and ttt_steps < 1:
        out.append(DrafterProblem("ttt-steps", f"{prefix}ttt_steps={ttt_steps}: must be >= 1"))
    if draft_vocab_size is not None and not 1 <= draft_vocab_size <= (vocab_size or draft_vocab_size):
        bound = f"[1, vocab_size={vocab_size}]" if vocab_size else ">= 1"
        out.append(DrafterProblem("draft-vocab-size", f"{prefix}draft_vocab_size={draft_vocab_size}: "
                                  f"must be in {bound}"))
    return out


def _aux_id_problems(ids: list[int], L: Optional[int], prefix: str) -> list[DrafterProblem]:
    key = f"{prefix}aux_layer_ids={ids}"
    if not ids:
        return [DrafterProblem("aux-ids-missing", f"{key}: no aux layer ids; without them engines pick their own "
                               "default layers, which need not be the ones the drafter was trained on")]
    out = []
    if any(b <= a for a, b in zip(ids, ids[1:])):
        # vLLM and SGLang append aux states as their layer loop passes each id, i.e. in layer order: fc's
        # column blocks of an unsorted (or repeated) list would receive other layers' states than in training.
        out.append(DrafterProblem("aux-ids-order", f"{key}: must be distinct and ascending ({sorted(set(ids))}); "
                                  "engines collect the aux states in layer order, whatever the list's order"))
    if ids[0] == 1:
        out.append(DrafterProblem("aux-ids-start-1", f"{key} starts with 1: SGLang adds 1 to every id of such a "
                                  "list (it reads it as 'output of layer i'); use boundary ids "
                                  "(default (2, L//2, L-3))"))
    if L is not None and any(not 1 <= i < L for i in ids):
        out.append(DrafterProblem("aux-ids-range", f"{key}: boundary ids must lie in [1, {L - 1}] for a target "
                                  f"with num_hidden_layers={L} (0 is the embedding, {L} the pre-norm output)"))
    return out


def raise_problems(problems: Sequence[DrafterProblem], skip: Sequence[str] = ()) -> None:
    """Raise ValueError with every problem's message (those whose code is in ``skip`` aside)."""
    kept = [p.message for p in problems if p.code not in skip]
    if kept:
        raise ValueError("; ".join(kept))
