"""The train stage's optimizer (``train.optim.name``): AdamW, or Muon on the drafter's hidden matrices with AdamW on
the rest, as one ``torch.optim.Optimizer`` that DeepSpeed wraps like any other.

Muon (Keller Jordan's; the update of ``torch.optim.Muon`` with ``adjust_lr_fn="match_rms_adamw"``, bit for bit,
tests/unit/train/test_optimizers.py) keeps a Nesterov momentum of each matrix's gradient and steps along its
orthogonalization (5 Newton-Schulz iterations in bf16), scaled by 0.2 sqrt(max(rows, cols)) so that its update has
AdamW's RMS and takes AdamW's lr. Which parameters it takes (:func:`muon_split`, as speculators' ``optimizers.py`` and
Muon's authors): the weights of the drafter's ``nn.Linear`` layers but its ``lm_head`` (fc, the attention and MLP
projections). AdamW takes the rest: norms, biases, vectors such as ``mask_hidden``, and the ``lm_head``, a
vocabulary-output matrix (embeddings are frozen and have no optimizer).

Under ZeRO-1/2 (and bf16 at stage 0) DeepSpeed hands the optimizer each group as one flat fp32 partition per rank,
its gradient already averaged, unscaled and clipped. The momentum and the Nesterov blend are elementwise, so they stay
sharded like Adam's moments; the orthogonalization needs whole matrices, so each step sums the ranks' slices of the
blended gradient into one buffer (an all-reduce of the Muon matrices in fp32) and each rank applies its own slice
of the result. Where each matrix lies in the partition is DeepSpeed's own map (``param._hp_mapping``, what its
``safe_get_full_*`` helpers read). ZeRO-3 keeps no such map and an offloaded optimizer steps on the host: the schema
refuses both with Muon (conf/schema.py ``_check_optim``).
"""

from __future__ import annotations

import itertools
import logging
import math

import torch
from torch import nn

from fledge.conf.schema import OptimConfig
from fledge.distributed import all_reduce_sum

log = logging.getLogger(__name__)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic Newton-Schulz iteration (torch.optim.Muon's)
NS_STEPS = 5


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters of ``model``: Muon takes the weights of its ``nn.Linear`` layers
    that are no ``lm_head``, AdamW everything else."""
    muon = {id(m.weight) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head" and min(m.weight.shape) > 1}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in muon], [p for p in params if id(p) not in muon]


def build_optimizer(model: nn.Module, o: OptimConfig, offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``train.optim`` (``o``) names over ``model``'s trainable parameters; ``offload``: ZeRO steps it
    on the host (DeepSpeed's CPU Adam; AdamW only)."""
    if len(o.betas) != 2:
        raise ValueError(f"train.optim.betas={o.betas}: expected two values, e.g. [0.9, 0.95]")
    adamw = {"lr": o.lr, "betas": tuple(o.betas), "weight_decay": o.weight_decay}
    if o.name == "muon":
        assert not offload, "conf/schema.py refuses train.optim.name=muon with deepspeed.offload_optimizer"
        muon, rest = muon_split(model)
        log.info("train: Muon on %d matrices (%d parameters), AdamW on %d tensors (%d parameters)", len(muon),
                 sum(p.numel() for p in muon), len(rest), sum(p.numel() for p in rest))
        return MuonAdamW(muon, rest, muon_lr=o.muon_lr or o.lr, momentum=o.muon_momentum,
                         muon_weight_decay=o.muon_weight_decay, **adamw)
    params = [p for p in model.parameters() if p.requires_grad]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **adamw)
    return torch.optim.AdamW(params, **adamw)


def ns_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the Newton-Schulz iteration on ``device``: bf16 on an accelerator (torch.optim.Muon's), fp32 on
    a CPU, where a SmolLM2 drafter's Muon step measured 4.6x slower in bf16 than in fp32 (2-core Xeon without native
    bf16, one thread: scripts/bench_muon.py, docs/performance.md), and fp32 is the more exact of the two."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def orthogonalize(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Newton-Schulz approximation of U V^T for g = U S V^T, in ``dtype`` (default :func:`ns_dtype`), op for op
    torch.optim.Muon's (which runs it in bf16 everywhere)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or ns_dtype(g.device), copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=1e-7))  # spectral norm <= 1
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def rms_scale(shape: torch.Size) -> float:
    """What Muon's lr is multiplied by for a matrix of ``shape``: its orthogonalized update then has AdamW's RMS
    (Moonshot's match_rms_adamw)."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class MuonAdamW(torch.optim.AdamW):
    """AdamW over ``adamw`` and Muon over ``muon`` (2-D matrices), one optimizer: group 0 is AdamW's (the lr the
    trainer logs), group 1 Muon's (``muon: True``, its own ``lr``, ``momentum`` and ``weight_decay``); one lr
    schedule scales both. Muon's state is a ``momentum_buffer`` (and a ``step``) per matrix, or per flat partition
    under ZeRO."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[nn.Parameter], *, muon_lr: float, momentum: float,
                 muon_weight_decay: float, **adamw_kw) -> None:
        assert all(p.ndim == 2 for p in muon), "Muon takes matrices"
        groups = [{"params": adamw, "muon": False}] if adamw else []
        if muon:
            groups.append({"params": muon, "muon": True, "lr": muon_lr, "momentum": momentum,
                           "weight_decay": muon_weight_decay})
        super().__init__(groups, **adamw_kw)
        self.matrices = list(muon)  # DeepSpeed swaps a group's params for its flat partition: the map keys on these
        self.offsets = [0, *itertools.accumulate(m.numel() for m in self.matrices)]  # in the gathered buffer
        self._covered = False

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW takes no closure"
        groups = self.param_groups
        try:  # DeepSpeed steps one group at a time the same way
            self.param_groups = [g for g in groups if not g["muon"]]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)

    def _muon_step(self, group: dict) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # and a step count, as Adam's state has (its __setstate__ needs one)
                state.update(step=torch.tensor(0.0), momentum_buffer=torch.zeros_like(p))
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            blend = p.grad.lerp(buf, beta)  # Nesterov
            if p.ndim == 2:  # the matrix itself: no ZeRO
                p.mul_(1 - lr * wd)
                p.add_(orthogonalize(blend), alpha=-lr * rms_scale(p.shape))
            else:  # a flat ZeRO partition holding slices of the matrices
                self._partition_step(p, blend, lr, wd)

    def _partition_step(self, flat: torch.Tensor, blend: torch.Tensor, lr: float, wd: float) -> None:
        """Muon's step on one rank's flat partition ``flat`` (``blend``: its slice of the Nesterov-blended
        gradient): every matrix gathered whole, orthogonalized where this rank holds a slice of it, each slice
        applied in place."""
        held = [(m, start, m._hp_mapping) for m, start in zip(self.matrices, self.offsets) if m._hp_mapping is not None]
        whole = torch.zeros(self.offsets[-1], dtype=blend.dtype, device=blend.device)
        for _, start, f in held:
            whole.narrow(0, start + f.lp_fragment_address.start, f.lp_fragment_address.numel).copy_(
                blend.narrow(0, f.hp_fragment_address.start, f.hp_fragment_address.numel))
        if not self._covered:
            self._check_covered(sum(f.lp_fragment_address.numel for *_, f in held))
        whole = all_reduce_sum(whole)  # each element is held by exactly one rank
        flat.mul_(1 - lr * wd)
        for m, start, f in held:
            update = orthogonalize(whole.narrow(0, start, m.numel()).view(m.shape)).flatten()
            flat.narrow(0, f.hp_fragment_address.start, f.hp_fragment_address.numel).add_(
                update.narrow(0, f.lp_fragment_address.start, f.lp_fragment_address.numel),
                alpha=-lr * rms_scale(m.shape))

    def _check_covered(self, held: int) -> None:
        """Once: the ranks' slices tile the matrices exactly (the all-reduce runs over the whole world, the group
        DeepSpeed partitions over in Fledge: train/sequence_parallel.py keeps every rank in it)."""
        got = int(all_reduce_sum(torch.tensor([held], dtype=torch.int64)).item())
        total = self.offsets[-1]
        assert got == total, f"the ranks' partitions hold {got} of the Muon matrices' {total} elements"
        self._covered = True
