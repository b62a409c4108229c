"""The registered training losses: each a :class:`~fledge.train.losses.base.TTTLoss` writing ``loss_sum`` from
divergences.py (the soft CE also its shared-teacher rewrite)."""

from __future__ import annotations

import dataclasses

import torch

from fledge.data.features.batch import FeatureBatch
from fledge.train.losses import divergences, paths
from fledge.train.losses.base import LOSSES, TTTLoss, TTTResult, _base_args, register_loss


@register_loss("ttt_ce")
class SoftCrossEntropy(TTTLoss):
    """Cross-entropy of the drafter against the teacher's distribution renormalised over the draft vocab,
    softmax and loss in fp32 (a bf16 KL has been measured 19-31% off in its gradient)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.soft_cross_entropy(logits, teacher_logits)

    def shared_teacher_sums(self, ys_flat, rows, th_flat, lm_head, teacher_head):
        # The rewrite below is this class's loss_sum: a subclass that changes the formula runs the fp32-head path.
        if type(self).loss_sum is not SoftCrossEntropy.loss_sum:
            return None
        impl = "auto" if self.impl == "auto" else "chunked"
        return paths.shared_teacher_steps(ys_flat, rows, th_flat, lm_head, teacher_head, impl, self.chunk_size)


@register_loss("rkl")
class ReverseKL(TTTLoss):
    """KL(q || p), drafter to teacher (divergences.py ``reverse_kl``)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.reverse_kl(logits, teacher_logits)


@register_loss("jsd")
class JensenShannon(TTTLoss):
    """The generalised JSD with the teacher's weight ``jsd_beta`` (divergences.py ``jsd``)."""

    options = ("jsd_beta",)

    def __init__(self, *, jsd_beta: float = 0.5, **base) -> None:
        super().__init__(**base)
        if not 0 < jsd_beta < 1:
            raise ValueError(f"drafter.loss_options.jsd_beta={jsd_beta}: must be in (0, 1) (0.5: symmetric JSD)")
        self.beta = jsd_beta

    def loss_sum(self, logits, teacher_logits):
        return divergences.jsd(logits, teacher_logits, self.beta)


@register_loss("tv")
class TotalVariation(TTTLoss):
    """TV(p, q) = 1 - the acceptance probability of a draft under speculative sampling
    (divergences.py ``total_variation``)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.total_variation(logits, teacher_logits)


@register_loss("lk_lambda")
class LKLambda(TTTLoss):
    """The LK hybrid of KL and TV, weighted per row by exp(-lk_eta alpha) (divergences.py ``lk_lambda``)."""

    options = ("lk_eta",)

    def __init__(self, *, lk_eta: float = 3.0, **base) -> None:
        super().__init__(**base)
        if not lk_eta >= 0:
            raise ValueError(f"drafter.loss_options.lk_eta={lk_eta}: must be >= 0 (0: pure forward KL)")
        self.eta = lk_eta

    def loss_sum(self, logits, teacher_logits):
        return divergences.lk_lambda(logits, teacher_logits, self.eta)


@register_loss("lk_alpha")
class LKAlpha(TTTLoss):
    """The LK negative log-acceptance -log alpha (divergences.py ``lk_alpha``)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.lk_alpha(logits, teacher_logits)


@register_loss("mix")
class Mix(TTTLoss):
    """``sum_i w_i L_i`` of registered losses, ``drafter.loss_mix={ttt_ce: 0.5, tv: 0.5}`` (weights as given,
    not normalised; each part with its ``drafter.loss_options``). One pass per chunk: every part reads the
    same logits. It runs the generic and fp32-head paths: a part other than the soft CE needs each step's
    logits anyway, and the soft CE on them is one more pass over the chunk."""

    def __init__(self, *, weights: dict[str, float], options: dict | None = None, **base) -> None:
        super().__init__(**base)
        names = sorted(n for n in LOSSES if n != "mix")
        bad = [n for n in weights if n not in names]
        if bad or not weights:
            what = f"{bad} not registered" if bad else "no losses"
            raise ValueError(f"drafter.loss_mix={dict(weights)}: {what}; name registered losses "
                             f"from {names} with their weights, e.g. '+drafter.loss_mix={{ttt_ce: 0.5, tv: 0.5}}'")
        options = options or {}
        self.parts = [(float(w), LOSSES.get(n)(**base, **{k: options[k] for k in LOSSES.get(n).options
                                                         if k in options}))
                      for n, w in weights.items() if w != 0]

    @classmethod
    def from_config(cls, drafter_cfg) -> Mix:
        return cls(weights=dict(drafter_cfg.loss_mix), options=dataclasses.asdict(drafter_cfg.loss_options),
                   **_base_args(drafter_cfg))

    def loss_sum(self, logits, teacher_logits):
        return sum(w * part.loss_sum(logits, teacher_logits) for w, part in self.parts)


def ttt_loss(drafter, batch: FeatureBatch, teacher_head: torch.Tensor, *, steps: int, step_weight: float,
             chunk_size: int, loss_impl: str = "auto") -> TTTResult:
    """The ``ttt_ce`` loss called once: ``SoftCrossEntropy(...)(drafter, batch, teacher_head)``."""
    return SoftCrossEntropy(steps=steps, step_weight=step_weight, chunk_size=chunk_size, impl=loss_impl)(
        drafter, batch, teacher_head)
