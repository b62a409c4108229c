"""The TTT alignment (docs/architecture.md, Training-time test), written once for the loss, held-out accuracy and the
AL estimate.

A ``FeatureBatch`` is unshifted: index t is token x_t and the target's state after reading x_0..x_t.
Step k of the unroll (k = 0..K-1) treats row t as a draft made ``lead(k) = 1 + k`` tokens after t:

- its input is token x_{t+lead} at RoPE position ``position_ids[t] + k`` (teacher forcing), with the
  feature ``A_t`` at step 0 and the state step k-1 fed back at row t after that; a parallel drafter
  (P-EAGLE) takes the mask token and its learned state at every step after the first instead, as the
  engine feeds its parallel slots;
- it is scored against teacher row t+lead: the target's distribution of x_{t+lead+1}, from
  ``target_hidden[t+lead]``, whose argmax is ``target_argmax[t+lead]``;
- it is *scored* when x_{t+lead+1} is a loss-masked token of row t's document (so padding, a document's
  end and the row's end never are): the accuracies and the AL estimate are over scored rows;
- it is *counted* (it enters the loss) when it is scored and that argmax lies in the draft vocab
  (``t2d``). The two differ on purpose. The loss's teacher is the target's distribution renormalised over
  the draft vocab; where the target's choice lies outside it, that distribution points at a token the
  target would not write, so the row is left out of the loss. Drafting cannot get such a row right
  (the drafter never proposes the token, so the engine rejects whatever it drafts there), so for the
  accuracies and the estimate of acceptance it is a miss: leaving it out would overstate AL wherever the
  target often writes tokens outside the draft vocab.

Every consumer goes through :func:`step_inputs` and :func:`step_rows`, so the shift is defined here only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.models.attention import TTTMask


def lead(k: int) -> int:
    """How far step ``k`` reads ahead of its row: its input token and its teacher row are t + lead(k)."""
    return 1 + k


def shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """``out[:, t] = x[:, t + s]``, ``fill`` past the end (dim 1 is time)."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def step_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``k``'s (token ids, RoPE positions) ``[B, T]``: x_{t+lead(k)} at ``position_ids[t] + k``."""
    return shift(input_ids, lead(k), 0), position_ids + k


@dataclass
class StepRows:
    """What step ``k`` is scored against, per row ``[B, T]``.

    ``teacher_argmax[t]`` is the target's argmax at row t + ``lead`` (a target-vocab id); ``counted[t]``
    says whether row t enters the loss, ``scored[t]`` whether it enters the accuracies (counted rows and
    the rows whose teacher argmax is outside the draft vocab: misses; module docstring). A scored row's
    teacher row t + lead lies in the same sequence, so flat indices ``r + lead`` over ``B*T`` rows are
    safe for scored (and so counted) rows only.
    """

    lead: int
    teacher_argmax: torch.Tensor
    counted: torch.Tensor
    scored: torch.Tensor


def step_rows(loss_mask: torch.Tensor, document_ids: torch.Tensor, target_argmax: torch.Tensor,
              t2d: torch.Tensor, k: int) -> StepRows:
    """Step ``k``'s teacher argmax, counted and scored rows (module docstring); all inputs ``[B, T]`` but
    ``t2d`` (bool ``[V]``, true at draft-vocab ids). ``document_ids`` is -1 on padding."""
    s = lead(k)
    teacher = shift(target_argmax, s, 0)
    # -2 past the end: never a document id, never the padding id.
    same_doc = (document_ids >= 0) & (shift(document_ids, s + 1, -2) == document_ids)
    scored = shift(loss_mask, s + 1, False) & same_doc
    return StepRows(lead=s, teacher_argmax=teacher, counted=scored & t2d[teacher], scored=scored)


def unroll(drafter, aux_hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
           document_ids: torch.Tensor, steps: int, shard=None) -> list[torch.Tensor]:
    """Unroll ``steps`` TTT steps of ``drafter`` (teacher forcing); returns y_k = norm(h2) ``[B, T, H]``
    per step, whose ``drafter.lm_head(y_k)`` are the step's logits over the draft vocab.

    ``shard`` (a train/sequence_parallel.py ``RowShard``; None on one rank): the inputs are a shard's rows
    plus its halo; the drafter runs on the first ``shard.rows`` of them, attends over the whole row through
    ``shard.sp.distribute``, and the halo's y are zeros (those rows never count nor score: :func:`step_rows` callers
    cut them)."""
    T = input_ids.shape[1]
    own = T if shard is None else shard.rows
    g = drafter.fuse(aux_hidden[:, :own])
    kv: list = []
    ys = []
    # built once: every step (and its backward) reads the same mask
    mask = TTTMask(document_ids if shard is None else shard.document_ids, steps)
    distribute = None if shard is None else shard.sp.distribute
    parallel = drafter.spec.parallel_drafting
    for k in range(steps):
        tokens, positions = step_inputs(input_ids, position_ids, k)
        tokens = tokens[:, :own]
        if k and parallel:  # P-EAGLE: the mask token and state, not the draft before (module docstring)
            tokens, g = drafter.parallel_inputs(tokens)
        y, g = drafter.ttt_step(tokens, g, positions[:, :own], mask, kv, distribute=distribute)
        ys.append(y if own == T else torch.nn.functional.pad(y, (0, 0, 0, T - own)))
    return ys


def ttt_states(drafter, batch, steps: int, shard=None) -> list[torch.Tensor]:
    """:func:`unroll` over a ``FeatureBatch`` (``shard``: see :func:`unroll`)."""
    return unroll(drafter, batch.aux_hidden, batch.input_ids, batch.position_ids, batch.document_ids, steps, shard)


# ------------------------------------------------------------------------------------ per-step accuracy
def step_key(name: str, k: int) -> str:
    """The logged name of per-step metric ``name`` at TTT step k ("full_acc_2")."""
    return f"{name}_{k}"


@dataclass
class StepAccuracy:
    """Teacher-forced accuracy per TTT step k = 0..K-1 (docs/architecture.md, Training-time test): ``acc[k]`` (drafter
    argmax = teacher argmax over step k's counted rows) and ``full_acc[k]`` (steps 0..k all right). NaN = no row."""

    acc: list[float]
    full_acc: list[float]

    @classmethod
    def from_values(cls, values: dict[str, float], steps: int, prefix: str = "") -> StepAccuracy:
        """From reduced metrics (``RatioMeter.reduce``) named by :func:`step_key`, e.g. ``eval/acc_0``."""
        get = lambda name, k: values.get(prefix + step_key(name, k), float("nan"))  # noqa: E731
        return cls([get("acc", k) for k in range(steps)], [get("full_acc", k) for k in range(steps)])


def al_estimate(accuracy: StepAccuracy) -> float:
    """Offline chain acceptance-length estimate: 1 + sum_k full_acc_k (docs/architecture.md, Training-time test),
    summed up to the first step without a value (NaN or None)."""
    total = 1.0
    for v in accuracy.full_acc:
        if v is None or v != v:
            break
        total += v
    return total
