"""The one batch type the trainer consumes, from the feature store (offline) or the live target (online).

All per-position tensors are *unshifted*: index t describes token x_t and the target's state after
reading x_0..x_t. The TTT loss (train/losses) does the shifting (docs/architecture.md, Training-time test).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [B, T] int64, token x_t
    loss_mask: torch.Tensor  # [B, T] bool, x_t is a token the target generates (assistant turn)
    aux_hidden: torch.Tensor  # [B, T, n*Ht] the target's boundary states at the aux ids, concatenated in id order
    target_hidden: torch.Tensor  # [B, T, Ht] the target's *final normed* state at t (teacher for x_{t+1})
    target_argmax: torch.Tensor  # [B, T] int64, argmax over the full vocab of the target's logits at t
    position_ids: torch.Tensor  # [B, T] int64, restarting at 0 for every packed document
    document_ids: torch.Tensor  # [B, T] int32, document index within the row; -1 for padding

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> FeatureBatch:
        """Move to ``device``; float tensors are also cast to ``dtype`` when given."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[f.name] = t.to(device, non_blocking=True)
        return FeatureBatch(**out)

    @property
    def num_tokens(self) -> int:
        return int((self.document_ids >= 0).sum())
