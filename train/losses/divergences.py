"""The row losses of the training objectives in train/losses, as sums over rows of fp32 logits.

Every function takes the drafter's logits ``b`` and the teacher's ``a`` over the draft vocab (fp32
``[rows, Vd]``; ``a`` carries no gradient) and returns the loss summed over the rows, an fp32 scalar
differentiable in ``b``. p = softmax(a) is the teacher, q = softmax(b) the drafter. Which rows count and how
each TTT step's sum is normalised is train/losses' business, the same for every objective.

Acceptance. Under speculative sampling a token drafted from q is accepted with probability
``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` (TV the total variation distance, ``0.5 sum_v |p_v - q_v|``),
so the drafter's expected acceptance at a position is one minus the TV between the two distributions.
Forward KL (the soft CE up to p's entropy) reaches the same optimum, q = p, but a drafter too small to get
there trades the two differently: KL pays for every unit of the target's mass the drafter misses, however
little it matters to acceptance.

p is the target's distribution renormalised over the draft vocab (the teacher head holds those rows only).
The acceptance of a drafted token against the full target, ``sum_{v in Vd} min(m p_v, q_v)`` with m the
target's mass on the draft vocab, is at most the alpha here; both are best at q = p.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The overlap below which -log(alpha) stops growing (and its gradient is zero): a row the drafter misses
# entirely must not make the loss infinite.
MIN_ACCEPTANCE = 1e-5


def soft_cross_entropy(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``-sum_v p_v log q_v`` per row, summed: forward KL(p || q) plus the teacher's entropy (a constant)."""
    return -(F.softmax(a, -1) * F.log_softmax(b, -1)).sum()


def forward_kl_rows(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row ``[rows]``."""
    logp = F.log_softmax(a, -1)
    return (logp.exp() * (logp - F.log_softmax(b, -1))).sum(-1)


def reverse_kl(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """KL(q || p) summed over rows: mode-seeking, the drafter is pushed off tokens the target gives little
    mass and is not charged for the target mass it leaves out."""
    logq = F.log_softmax(b, -1)
    return (logq.exp() * (logq - F.log_softmax(a, -1))).sum()


def jsd(b: torch.Tensor, a: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence summed over rows: ``beta KL(p || m) + (1 - beta) KL(q || m)``
    with the mixture ``m = beta p + (1 - beta) q``, 0 < beta < 1. beta = 0.5 is the symmetric JSD (at most
    log 2 per row); divided by beta it tends to forward KL as beta -> 0, divided by 1 - beta to reverse KL
    as beta -> 1 (the convention of TRL's GKD and Liger's JSD)."""
    logp, logq = F.log_softmax(a, -1), F.log_softmax(b, -1)
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * (logp.exp() * (logp - logm)).sum() + (1 - beta) * (logq.exp() * (logq - logm)).sum()


def tv_rows(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1 - alpha per row ``[rows]``, written as ``0.5 sum |p - q|`` so that a small TV is not the
    difference of two numbers near 1."""
    return 0.5 * (F.softmax(a, -1) - F.softmax(b, -1)).abs().sum(-1)


def total_variation(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """TV(p, q) summed over rows: the expected rejections, one minus the acceptance (module docstring).
    Its gradient in q is the sign of q - p: it does not grow with how far q is from p, so it is weak when
    the drafter is far off (every row's mass is misplaced at once)."""
    return tv_rows(b, a).sum()


def lk_lambda(b: torch.Tensor, a: torch.Tensor, eta: float) -> torch.Tensor:
    """The LK hybrid, summed over rows: ``lambda KL(p || q) + (1 - lambda) TV(p, q)`` per row with
    ``lambda = exp(-eta alpha)``, alpha the row's acceptance taken as a constant (no gradient through the
    weight). Where the drafter's overlap with the target is small, lambda ~ 1 and the row trains on KL's
    strong gradient; as alpha grows the row moves to TV, which is the rejection rate itself.

    This is the hybrid of Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative
    Decoding" (arXiv 2602.23881), with lambda per row as the speculators library computes it. SpecForge and
    NeMo Automodel take lambda from the mean alpha of the step's batch instead; per row keeps the loss a
    sum of row terms, so an optimizer step trains on the same objective however its rows fall into
    micro-batches and ranks (train/losses/base.py ``step_denominators``)."""
    tv = tv_rows(b, a)
    weight = torch.exp(-eta * (1 - tv.detach()))
    return (weight * forward_kl_rows(b, a) + (1 - weight) * tv).sum()


def lk_alpha(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The LK negative log-acceptance, ``-log alpha`` per row, summed (alpha = sum_v min(p_v, q_v), floored
    at MIN_ACCEPTANCE). Its gradient is TV's scaled by 1 / alpha: TV's optimum, with a gradient that does
    not vanish when the drafter starts far off (Samarin et al., arXiv 2602.23881; SpecForge's and NeMo
    Automodel's ``lk_loss_type=alpha``, speculators' ``nla``). For a one-hot teacher it is the hard-label
    cross-entropy."""
    alpha = torch.minimum(F.softmax(a, -1), F.softmax(b, -1)).sum(-1)
    return -torch.log(alpha.clamp_min(MIN_ACCEPTANCE)).sum()
