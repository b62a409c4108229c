"""What every drafter module shares (models/drafter.py's EAGLE drafter, models/dflash.py's DFlash drafter): the RoPE
of the target, kept fp32 through dtype casts, one switch for all its RMSNorms' implementation, and the draft vocab
map (docs/architecture.md, The draft vocabulary)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fledge.models.kernels.rmsnorm import RMSNorm


def t2d_of(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``t2d`` (bool ``[V]``) of a ``d2t`` map: true at the target ids i + d2t[i] (engines ship only ``d2t``)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t.to(torch.int64).cpu()] = True
    return t2d


class DrafterModule(nn.Module):
    """A drafter's ``nn.Module`` base. ``norm_impl`` selects every RMSNorm's implementation (torch | triton; see
    models/kernels/rmsnorm.py) and may be changed on the instance; :meth:`init_rope` installs ``rotary_emb``,
    :meth:`init_vocab` the draft vocab map ``d2t`` / ``t2d`` that :meth:`draft_to_target` reads."""

    def init_vocab(self, draft_vocab_size: int, vocab_size: int, persistent: bool = True) -> None:
        """The ``d2t`` / ``t2d`` buffers of a draft vocab of ``draft_vocab_size`` ids out of ``vocab_size``: the first
        ids until :meth:`set_vocab`. ``persistent``: whether they belong to the state_dict (checkpoints, exports)."""
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64), persistent=persistent)
        self.register_buffer("t2d", torch.arange(vocab_size) < draft_vocab_size, persistent=persistent)

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab map: target id = i + d2t[i]; t2d true at those ids."""
        Vd, V = self.d2t.shape[0], self.t2d.shape[0]
        if d2t.shape != (Vd,) or t2d.shape != (V,):
            raise ValueError(f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}: "
                             f"expected ({Vd},), ({V},)")
        sel = torch.arange(Vd) + d2t.cpu()
        if int(t2d.sum()) != Vd or not bool(t2d.cpu()[sel].all()):
            raise ValueError("vocab map: t2d must be true exactly at the target ids i + d2t[i]")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids via ``d2t`` (an offset table)."""
        return draft_ids + self.d2t[draft_ids]

    def init_rope(self, config: LlamaConfig) -> None:
        """transformers' RoPE of ``config`` (llama3/yarn/linear...), its frequencies kept fp32 (:meth:`_apply`)."""
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._inv_freq_fp32 = self.rotary_emb.inv_freq.detach().clone()

    @property
    def norm_impl(self) -> str:
        return self._norm_impl

    @norm_impl.setter
    def norm_impl(self, impl: str) -> None:
        if impl not in ("torch", "triton"):
            raise ValueError(f"drafter.norm_impl={impl!r}: expected torch | triton")
        self._norm_impl = impl
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.impl = impl

    def _apply(self, fn, recurse=True):
        # .to(bfloat16) would cast the RoPE frequencies too (wrong angles at long positions): restore fp32
        super()._apply(fn, recurse)
        rot = self.rotary_emb
        rot.inv_freq = self._inv_freq_fp32.to(rot.inv_freq.device)
        rot.original_inv_freq = rot.inv_freq.clone()
        return self
