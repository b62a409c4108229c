"""Training losses (docs/architecture.md, Training-time test): the registry ``drafter.loss`` selects from, and the
shared TTT code.

A loss is a :class:`TTTLoss` subclass registered under a name. It writes one method, ``loss_sum``: the
summed loss of some rows given their drafter logits and teacher logits over the draft vocab (fp32
``[rows, Vd]`` each). Everything else is shared and written once here or in models/alignment.py: the
unroll of K steps, which rows count at step k and against which teacher row, the step weights
(``sum_k w^k L_k``, L_k the mean over step k's counted rows of the whole optimizer step: every micro-batch
on every rank, :func:`step_denominators`), the metrics, and the execution::

    @register_loss("my_loss")
    class MyLoss(TTTLoss):
        def loss_sum(self, logits, teacher_logits):
            ...  # a fp32 scalar, differentiable in logits

    # then train with drafter.loss=my_loss (TTTModel receives build_loss(cfg.drafter))

Registered: ``ttt_ce`` (the soft CE, forward KL up to a constant; the default), ``rkl``, ``jsd``
(``drafter.loss_options.jsd_beta``), ``tv``, ``lk_lambda`` (``drafter.loss_options.lk_eta``), ``lk_alpha``
and ``mix`` (``drafter.loss_mix``: weights of any of the others); their formulas and what each optimises
are in train/divergences.py.

Execution paths. Under ZeRO-3, ``loss_sum`` runs through the *generic* path: per step, in row chunks
recomputed in backward, the logits come from ``lm_head``'s own forward (the partitioned lm_head weight
exists only inside that forward). Elsewhere it runs through the *fp32-head* path
(models/kernels/head_loss.py): step k reads teacher row t+1+k, so the steps share teacher rows, and there
each chunk of teacher rows has its logits computed once for all K steps (measured 25% less time than per
step at K=7); logits come from fp32-result GEMMs and lm_head's gradient is summed in fp32, which in bf16
keeps the gradient accurate near convergence where the generic path's is not. Both derive from
``loss_sum``: a new loss gets them for free. The soft CE has, besides, its own *shared-teacher* rewrite:
``-sum_i p_i log softmax(y W)_i = lse(y W) - y . q`` with ``q = p W`` depending on the teacher row alone,
so q is computed once per batch and each step pays for its drafter logsumexp only (on CUDA a Triton
kernel). That rewrite cannot be derived from ``loss_sum``: a loss that has one provides
``shared_teacher_sums`` itself, and a test pins it to the generic path
(tests/unit/train/test_loss.py::test_zero3_path_equals_the_shared_teacher_path). The other registered losses
have none: each couples p_v and q_v through a non-linear function per vocab entry, so the teacher's part
does not reduce to a vector per teacher row.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.checkpoint import checkpoint

from fledge.conf.drafter_rules import drafter_problems, raise_problems
from fledge.data.features.batch import FeatureBatch
from fledge.distributed import all_reduce_sum
from fledge.models import alignment
from fledge.models.alignment import step_key
from fledge.models.kernels import draft_cross_entropy, draft_logsumexp, fp32_grad, teacher_expectation
from fledge.models.kernels.head_loss import head_loss_steps
from fledge.registry import Registry
from fledge.train import divergences


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, sum_k w^k L_k, for backward
    # name -> (numerator, denominator), float64, detached: loss_k, acc_k, full_acc_k for k = 0..K-1.
    # Sum both over ranks / micro-batches, then divide.
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]


class TTTLoss(ABC):
    """A TTT loss: ``loss_sum`` (the formula) plus the unroll, alignment, step weights and metrics.

    ``steps`` is K, ``step_weight`` w, ``chunk_size`` the rows per chunk of logits, ``impl`` the
    shared-teacher path's implementation (auto: Triton on CUDA; torch). Call it as
    ``loss(drafter, batch, teacher_head)``; ``teacher_head`` ``[Vd, Ht]`` holds the draft-vocab rows of the
    target's lm_head in draft-id order.
    """

    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()  # the drafter.loss_options fields the constructor takes

    def __init__(self, *, steps: int, step_weight: float, chunk_size: int, impl: str = "auto") -> None:
        raise_problems(drafter_problems(ttt_steps=steps))
        if chunk_size < 1:
            raise ValueError(f"drafter.loss_chunk_size={chunk_size}: must be >= 1")
        if impl not in ("auto", "torch"):
            raise ValueError(f"drafter.loss_impl={impl!r}: expected auto | torch")
        self.steps, self.step_weight, self.chunk_size, self.impl = steps, step_weight, chunk_size, impl

    @abstractmethod
    def loss_sum(self, logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """The loss summed over rows: fp32 scalar from the drafter's ``logits`` and the teacher's
        ``teacher_logits`` (both fp32 ``[rows, Vd]``; the teacher's carry no gradient)."""

    @classmethod
    def from_config(cls, drafter_cfg) -> TTTLoss:
        """This loss with ``drafter_cfg``'s (a ``DrafterConfig``) K, w, chunk size, impl and options."""
        return cls(**_base_args(drafter_cfg), **{k: getattr(drafter_cfg.loss_options, k) for k in cls.options})

    def shared_teacher_sums(self, ys_flat, rows, th_flat, lm_head, teacher_head):
        """An optional rewrite outside ZeRO-3, with the generic path's result: per step, (summed loss over
        its counted rows, those flat row indices, the drafter's argmax at them); None = the fp32-head path."""
        return None

    def __call__(self, drafter, batch: FeatureBatch, teacher_head: torch.Tensor, shard=None,
                 denominators: torch.Tensor | None = None) -> TTTResult:
        """Unroll ``self.steps`` TTT steps of ``drafter`` on ``batch`` and score them: returns the weighted
        loss ``sum_k w^k S_k / denominators[k]`` (S_k the summed loss of step k's counted rows) and
        numerator/denominator metrics: ``loss_k`` over step k's counted rows, ``acc_k`` over its scored
        rows (models/alignment.py: a teacher argmax outside the draft vocab is a miss), ``full_acc_k`` over
        the rows whose steps 0..k are all scored, right when all of them are.

        ``denominators`` (``[K]``): the trainer's, from :func:`step_denominators`, so that an optimizer
        step of many micro-batches on many ranks trains on the mean over all of their rows. None: this
        batch is the whole optimizer step, L_k the mean over its counted rows.

        ``shard`` (sequence parallelism, train/sequence_parallel.py; None on one rank): ``batch`` is one
        rank's shard plus halo; only its own rows count, and without ``denominators`` L_k is normalised by
        the rows the whole group counts and scaled by the group size (DeepSpeed averages gradients over
        every rank): :func:`step_denominators` for a group that is the whole step."""
        Vd = drafter.spec.draft_vocab_size
        if teacher_head.shape[0] != Vd:
            raise ValueError(f"teacher_head has {teacher_head.shape[0]} rows; drafter.draft_vocab_size={Vd}")
        B, T = batch.input_ids.shape
        th_flat = batch.target_hidden.reshape(B * T, -1)
        ys = alignment.ttt_states(drafter, batch, self.steps, shard)
        rows = [_flat(s) for s in self._step_rows(drafter, batch, shard)]
        ys_flat = [y.reshape(B * T, -1) for y in ys]
        if _partitioned(drafter.lm_head):  # under ZeRO-3 only lm_head's own forward sees its weight
            scored = _per_step_module_calls(self.loss_sum, ys_flat, rows, th_flat, drafter.lm_head, teacher_head,
                                            self.chunk_size)
        else:
            scored = self.shared_teacher_sums(ys_flat, rows, th_flat, drafter.lm_head, teacher_head)
            if scored is None:
                scored = _fp32_head_steps(self.loss_sum, ys_flat, rows, th_flat, drafter.lm_head, teacher_head,
                                          self.chunk_size)
        return self._weigh(drafter, rows, scored, ys[0].device, shard, denominators)

    def counted_rows(self, drafter, batch: FeatureBatch, shard=None) -> torch.Tensor:
        """Per step k, how many rows of ``batch`` step k's loss trains on (``[K]`` int64, on the batch's
        device; with ``shard``, this rank's own rows): summed over an optimizer step's micro-batches, what
        :func:`step_denominators` takes."""
        return torch.stack([s.counted.sum() for s in self._step_rows(drafter, batch, shard)])

    def _step_rows(self, drafter, batch: FeatureBatch, shard=None) -> list[alignment.StepRows]:
        t2d = drafter.t2d.to(batch.loss_mask.device)  # the trainer counts a step's rows before they move
        rows = [alignment.step_rows(batch.loss_mask, batch.document_ids, batch.target_argmax, t2d, k)
                for k in range(self.steps)]
        if shard is not None:
            for s in rows:  # the halo: the next shard's rows
                s.counted[:, shard.rows:] = False
                s.scored[:, shard.rows:] = False
        return rows

    def _weigh(self, drafter, rows, scored, device, shard=None, denominators=None) -> TTTResult:
        total = torch.zeros((), dtype=torch.float32, device=device)
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        chain_scored = chain_right = None
        f64 = lambda x: x.detach().to(torch.float64)  # noqa: E731
        counts = torch.stack([s.counted.sum() for s in rows])
        if denominators is None:  # this batch is the optimizer step: on one rank, or on one group of N
            denominators = _nonzero(counts if shard is None else shard.sp.group_sum(counts) / shard.sp.size)
        denominators = denominators.to(device, torch.float32)
        for k, (step, (loss_sum, r, pred)) in enumerate(zip(rows, scored)):
            right = torch.zeros_like(step.counted)
            if pred is not None:
                right[r] = drafter.draft_to_target(pred) == step.teacher_argmax[r]
            n = counts[k]
            total = total + self.step_weight**k * loss_sum / denominators[k]
            # scored rows outside the loss (teacher argmax outside the draft vocab) stay misses (alignment.py)
            chain_scored = step.scored if chain_scored is None else chain_scored & step.scored
            chain_right = right if chain_right is None else chain_right & right
            metrics[step_key("loss", k)] = (f64(loss_sum), f64(n))
            metrics[step_key("acc", k)] = (f64(right.sum()), f64(step.scored.sum()))
            metrics[step_key("full_acc", k)] = (f64((chain_right & chain_scored).sum()), f64(chain_scored.sum()))
        return TTTResult(loss=total, metrics=metrics)


def step_denominators(counts: torch.Tensor, divisor: float) -> torch.Tensor:
    """What every micro-batch of an optimizer step divides step k's summed loss S_k by (``[K]`` float64,
    the same on every rank): ``N_k / divisor``. ``counts``: this rank's :meth:`TTTLoss.counted_rows`
    summed over its micro-batches of the step; N_k is their sum over every rank (one all-reduce, so every
    rank calls this). ``divisor``: how many micro-batch losses the optimizer's gradient is the mean of
    (train/deepspeed_setup.py ``gradient_divisor``: DeepSpeed's grad_accum x data-parallel world).

    Then the gradient the optimizer sees is that of ``sum_k w^k (sum of S_k over every micro-batch and
    rank) / N_k``: the loss of one batch holding all of the step's rows, each row weighing the same
    however the rows fall into micro-batches and ranks (a micro-batch's own mean would weigh one of 50
    rows as much as one of 5,000). A step with no counted row at k divides by 1 (its S_k is 0)."""
    return _nonzero(all_reduce_sum(counts.detach().to(torch.float64)) / divisor)


def _nonzero(denominators: torch.Tensor) -> torch.Tensor:
    return torch.where(denominators > 0, denominators, torch.ones_like(denominators))


LOSSES: Registry[type[TTTLoss]] = Registry("drafter.loss", "train/loss.py")


def register_loss(name: str):
    """Class decorator: make a :class:`TTTLoss` subclass selectable as ``drafter.loss=<name>``."""

    def add(cls: type[TTTLoss]) -> type[TTTLoss]:
        LOSSES.register(name, cls)
        cls.name = name
        return cls

    return add


def check_loss_config(drafter_cfg) -> None:
    """ValueError unless ``drafter_cfg`` (a ``DrafterConfig``) selects a loss that can be built: its name and,
    for ``mix``, every name in ``drafter.loss_mix`` registered (the schema checks the values; it cannot see
    the registry)."""
    build_loss(drafter_cfg)


def build_loss(drafter_cfg) -> TTTLoss:
    """The loss ``drafter_cfg`` (a ``DrafterConfig``) selects, with its K, w, chunk size, impl and options."""
    return LOSSES.get(drafter_cfg.loss).from_config(drafter_cfg)


def _base_args(drafter_cfg) -> dict:
    return dict(steps=drafter_cfg.ttt_steps, step_weight=drafter_cfg.step_weight,
                chunk_size=drafter_cfg.loss_chunk_size, impl=drafter_cfg.loss_impl)


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
        return _shared_teacher_steps(ys_flat, rows, th_flat, lm_head, teacher_head, impl, self.chunk_size)


@register_loss("rkl")
class ReverseKL(TTTLoss):
    """KL(q || p), drafter to teacher (train/divergences.py ``reverse_kl``)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.reverse_kl(logits, teacher_logits)


@register_loss("jsd")
class JensenShannon(TTTLoss):
    """The generalised JSD with the teacher's weight ``jsd_beta`` (train/divergences.py ``jsd``)."""

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
    (train/divergences.py ``total_variation``)."""

    def loss_sum(self, logits, teacher_logits):
        return divergences.total_variation(logits, teacher_logits)


@register_loss("lk_lambda")
class LKLambda(TTTLoss):
    """The LK hybrid of KL and TV, weighted per row by exp(-lk_eta alpha) (train/divergences.py ``lk_lambda``)."""

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
    """The LK negative log-acceptance -log alpha (train/divergences.py ``lk_alpha``)."""

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


# ---------------------------------------------------------------------------------------- execution
def _flat(step: alignment.StepRows) -> alignment.StepRows:
    return alignment.StepRows(step.lead, step.teacher_argmax.reshape(-1), step.counted.reshape(-1),
                              step.scored.reshape(-1))


def _partitioned(lm_head) -> bool:
    """ZeRO-3 partitions lm_head's weight and gathers it only inside lm_head's own forward."""
    return hasattr(lm_head.weight, "ds_id")


def _fp32_head_steps(loss_sum, ys_flat, rows, th_flat, lm_head, teacher_head, chunk_size):
    """Any ``loss_sum`` per step k, outside ZeRO-3: (summed over its counted rows, those rows, the drafter's
    argmax there), through models/kernels/head_loss.py: fp32 logits, the teacher's computed once per chunk of
    teacher rows for every step, chunks recomputed in backward, lm_head's gradient summed in fp32 through one
    ``fp32_grad`` stand-in. A step without counted rows still gives lm_head a (zero) gradient: every rank
    reduces the same buckets."""

    idx = [s.counted.nonzero().squeeze(1) for s in rows]
    scored = head_loss_steps([y[r] for y, r in zip(ys_flat, idx)], lm_head.weight, th_flat,
                             teacher_head.to(th_flat.dtype), [r + s.lead for r, s in zip(idx, rows)], loss_sum,
                             chunk_size, grad_into=fp32_grad(lm_head.weight))
    return [(total, r, pred if r.numel() else None) for (total, pred), r in zip(scored, idx)]


def _shared_teacher_steps(ys_flat, rows, th_flat, lm_head, teacher_head, impl, chunk_size):
    """The soft CE per step k: (summed over its counted rows, those rows, the drafter's argmax there).

    The teacher's expected head row q (models/kernels/fused_loss.py) is computed once for the union of
    the teacher rows any step needs, and each step pays only for its drafter logsumexp. No [rows, Vd]
    tensor outlives a chunk. lm_head's gradient is, per step and for the teacher, a large term of nearly
    the size of its neighbours' with the opposite sign; they all sum in fp32 through one ``fp32_grad``
    stand-in and reach the weight rounded once (rounding each term first loses ~4% near convergence).
    """

    w = lm_head.weight
    w_grad = fp32_grad(w)
    idx = [s.counted.nonzero().squeeze(1) for s in rows]
    wanted = torch.unique(torch.cat([r + s.lead for s, r in zip(rows, idx)]))  # counted => in range
    slot = torch.full((rows[0].counted.numel(),), -1, dtype=torch.long, device=w.device)
    slot[wanted] = torch.arange(wanted.numel(), device=w.device)
    q = teacher_expectation(th_flat[wanted], teacher_head.to(th_flat.dtype), w, chunk_size, grad_into=w_grad)
    out = []
    for y, s, r in zip(ys_flat, rows, idx):
        if r.numel() == 0:  # one weight-0 row keeps lm_head (and y) in every rank's graph
            lse, _ = draft_logsumexp(y[:1], w, impl, chunk_size, grad_into=w_grad)
            out.append((0.0 * lse.sum(), r, None))
            continue
        loss_rows, pred = draft_cross_entropy(y[r], w, q, slot[r + s.lead], impl, chunk_size, grad_into=w_grad)
        out.append((loss_rows.sum(), r, pred))
    return out


def _chunk_loss(loss_sum, y, teacher_hidden, lm_head, teacher_head):
    """``loss_sum`` over rows of y (fp32 logits from lm_head's forward) and the drafter's argmax there."""
    logits = lm_head(y).float()
    with torch.no_grad():
        teacher_logits = (teacher_hidden @ teacher_head.T).float()
    return loss_sum(logits, teacher_logits), logits.detach().argmax(-1)


def _per_step_module_calls(loss_sum, ys_flat, rows, th_flat, lm_head, teacher_head, chunk_size):
    """The generic path: ``loss_sum`` through lm_head's own forward, step by step, chunk by chunk.

    Chunks tile all B*T positions (only counted rows are computed), so every rank calls lm_head the
    same number of times whatever its mask (ZeRO-3 gathers the weight per call, and every rank needs
    the same graph); an empty chunk computes one row with weight 0. Each chunk's logits live only
    inside a checkpointed function.
    """
    use_ckpt = torch.is_grad_enabled()
    out = []
    for y, s in zip(ys_flat, rows):
        c = s.counted
        total, kept, preds = y.new_zeros((), dtype=torch.float32), [], []
        for a in range(0, c.numel(), chunk_size):
            r = a + c[a : a + chunk_size].nonzero().squeeze(1)
            empty = r.numel() == 0
            rr = r.new_tensor([a]) if empty else r
            args = (loss_sum, y[rr], th_flat[rr if empty else rr + s.lead], lm_head, teacher_head)
            part, pred = checkpoint(_chunk_loss, *args, use_reentrant=False) if use_ckpt else _chunk_loss(*args)
            total = total + (0.0 * part if empty else part)
            if not empty:
                kept.append(r)
                preds.append(pred)
        r = torch.cat(kept) if kept else c.nonzero().squeeze(1)
        out.append((total, r, torch.cat(preds) if preds else None))
    return out
