"""Attention-drift diagnostics (docs/architecture.md, The drafter, EAGLE-3.1's reason): where the drafter looks at each
draft depth, and how large the state it feeds back is.

Per draft depth d (0 = the last committed row, which makes draft 1; d >= 1 = the fed-back steps):

- ``sink``: attention mass on key 0 (the first token, the usual attention sink);
- ``context``: mass on the other committed rows (prompt + accepted tokens, fed with real target states);
- ``drafted``: mass on the drafter's own draft rows of this round (0 at depth 0);
- ``state_rms``: RMS of the state fed in at that depth (the fused target feature at depth 0).

With pre-norm feedback (EAGLE-3) the fed-back RMS grows with depth and the mass moves from sink and
context to the drafted rows; post-norm feedback (EAGLE-3.1) keeps the RMS at about 1.

The probabilities are recomputed exactly from what the engine path uses: the attention's own ``project``
(every layer kind of models/layers/ has one) gives the query as the attention sees it, wrapped while the
probe is open, and the ``DraftCache`` holds the keys after RoPE. Nothing in the drafter changes.

The target's MTP module (``drafter=mtp``, models/mtp_drafter.py) is probed chained as vLLM 0.32 chains it: depth 0
reads the target's final normed state, depth d >= 1 the step before's ``shared_head.norm(out)`` (``norm_output``;
``out`` without), so ``state_rms`` is that state's RMS. Its attention is transformers', so it hands each query over
itself (``watch_queries``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fledge.evaluation.speculative import DrafterProposer, TargetRunner
from fledge.models.drafter import DraftCache
from fledge.progress import progress

FIELDS = ("sink", "context", "drafted", "state_rms")


class DriftProbe:
    """Accumulates the per-depth diagnostics; pass it as ``DrafterProposer(drafter, probe=...)``."""

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter
        self._q: torch.Tensor | None = None
        self.sums: dict[int, torch.Tensor] = {}  # depth -> [sink, context, drafted, rms, count]
        self.last_probs: torch.Tensor | None = None  # [Hq, L] of the latest record (tests check it)
        # Keep the last query as the attention sees it (RoPE, q/k norms, MLA's scale and padding applied) while the
        # probe is open: a drafter whose attention is transformers' hands it over itself (models/mtp_drafter.py).
        watch = getattr(drafter, "watch_queries", None)
        self._stop = watch(self._keep) if watch is not None else self._wrap_project(drafter.midlayer.self_attn)

    def _keep(self, q: torch.Tensor) -> None:
        self._q = q[:1, :, -1:].detach()  # [1, Hq, 1, D]

    def _wrap_project(self, attn: nn.Module):
        """Every layer kind (models/layers/) makes its q, k, v in ``project``: shadow it until :meth:`close`."""
        project = attn.project

        def keep_last_query(z: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = project(z, cos, sin)
            self._keep(q)
            return q, k, v

        attn.project = keep_last_query  # an instance attribute: shadows the method until close()
        return lambda: attn.__dict__.pop("project", None)

    def close(self) -> None:
        self._stop()

    @torch.no_grad()
    def record(self, depth: int, position: int, fed: torch.Tensor, cache: DraftCache, n_context: int) -> None:
        """Called after the draft step at ``depth`` (query at RoPE ``position``; ``fed`` the state fed in;
        ``cache`` the DraftCache after that step; keys < ``n_context`` are committed rows)."""
        q = self._q  # [1, Hq, 1, D], at RoPE ``position``
        Hq, D = q.shape[1], q.shape[-1]
        k = cache.k[:1]  # [1, Hkv, L, D], RoPE applied when cached
        k = k.repeat_interleave(Hq // k.shape[1], dim=1)
        probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D), -1)[0, :, 0]
        self.last_probs = probs
        p = probs.mean(0)  # head average
        row = torch.stack([p[0], p[1:n_context].sum(), p[n_context:].sum(),  # on the drafter's device
                           fed.float().pow(2).mean().sqrt(), p.new_tensor(1.0)]).double().cpu()
        self.sums[depth] = self.sums[depth] + row if depth in self.sums else row

    def summary(self) -> dict[str, list[float]]:
        """{"depth": [...], "sink": [...], "context": [...], "drafted": [...], "state_rms": [...],
        "count": [...]}: means over every recorded draft at each depth."""
        depths = sorted(self.sums)
        out: dict[str, list[float]] = {"depth": depths}
        for i, name in enumerate(FIELDS):
            out[name] = [float(self.sums[d][i] / self.sums[d][4]) for d in depths]
        out["count"] = [int(self.sums[d][4]) for d in depths]
        return out


def drift_curves(drafter: nn.Module, target: TargetRunner, prompts: Sequence[Sequence[int]], depth: int,
                 desc: str = "drift") -> dict:
    """Greedy chain drafts of ``depth`` tokens after each prompt (no verification: the diagnostics are
    about the drafter's own unroll), returning ``DriftProbe.summary()``. ``target`` is a
    ``models.speculative.TargetRunner`` built with the drafter's aux layer ids."""
    probe = DriftProbe(drafter)
    proposer = DrafterProposer(drafter, probe=probe)
    try:
        for prompt in progress(prompts, desc=desc, leave=False):
            target.reset()
            proposer.reset()
            logits, aux = target.prefill(prompt)
            x = int(logits[-1].argmax())
            proposer.observe(list(prompt[1:]) + [x], aux)
            proposer.propose(list(prompt) + [x], depth)
    finally:
        probe.close()
    return probe.summary()
