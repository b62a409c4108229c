"""What every drafter module shares (models/drafter.py's EAGLE drafter, models/dflash.py's DFlash drafter): the RoPE
of the target, kept fp32 through dtype casts, and one switch for all its RMSNorms' implementation."""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fledge.models.kernels.rmsnorm import RMSNorm


class DrafterModule(nn.Module):
    """A drafter's ``nn.Module`` base. ``norm_impl`` selects every RMSNorm's implementation (torch | triton; see
    models/kernels/rmsnorm.py) and may be changed on the instance; :meth:`init_rope` installs ``rotary_emb``."""

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
