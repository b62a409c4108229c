"""The target's own MTP module (models/mtp.py) fine-tuned as a multi-step drafter: the spec (``MtpSpec``), the drafter
(``MtpDrafter``) and the algorithm ``mtp``, served by vLLM 0.32 with ``method: mtp``.

The drafter runs the module exactly as vLLM chains it (v1/spec_decode/llm_base_proposer.py ``propose`` over
model_executor/models/deepseek_mtp.py; tests/engine/test_vllm_mtp_chain.py holds the two together):

- draft 1 at slot t reads the target's hidden state at t *after* its final norm (the target model's output,
  deepseek_v2.py ``DeepseekV2Model.forward``) and token t+1, at position t;
- draft j > 1 reads the drafted token and the state the step before fed back, one position on. vLLM 0.32 feeds back
  ``shared_head.norm(out)`` (``DeepSeekMultiTokenPredictorLayer.forward`` returns (out, shared_head(out)) and the
  proposer feeds the second: ``model_returns_tuple``), EAGLE-3.1's post-norm feedback: ``norm_output`` true. False
  feeds back ``out`` (the pre-norm residual: EAGLE-3's rule, and what vLLM fed before it returned the pair), which
  trains a drafter vLLM 0.32 cannot serve as trained (serving/mtp_layout.py's lint says so).

EAGLE-3.1's other fix, a norm on every state entering the layer, the module has already: ``hnorm`` on the fed state
and ``enorm`` on the embedding, before ``eh_proj``; so an MTP spec has no ``fc_norm``.

Its input is one target state, the final normed one: aux id ``L`` (``hidden_states[L]`` of a transformers forward,
what models/target.py returns for it), in place of EAGLE's aux states. The embedding and the output head are the
target's, frozen (vLLM shares them), and the draft vocab is the target's whole vocab. The module's tensors live
under ``layers.{L}.`` (vLLM's ``DeepSeekMultiTokenPredictor.layers``), so an export can name the layer.

Training (train/objectives/mtp.py) unrolls it over K steps with the TTT attention of models/attention.py: the
module's attention is transformers', and its scores are computed by the attention function registered here, which
the step hands its keys' owner through the mask argument transformers passes along untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fledge.models.attention import cached_attention, resolve_attention, ttt_attention_over
from fledge.models.drafter_module import DrafterModule
from fledge.models.families import read_target, text_config_dict
from fledge.models.mtp import DECODERS, MTPModule
from fledge.models.spec import ALGORITHMS, Algorithm, DrafterSpec, option

ATTENTION = "fledge_mtp"  # the attention implementation the drafter's module runs (registered below)


@dataclass
class MtpSpec(DrafterSpec):
    """The target's MTP module as a chain drafter: ``target_config`` (the target's config.json, its text part) builds
    the module; ``norm_output`` picks the fed-back state (module docstring). ``aux_layer_ids`` is ``[L]``."""

    algorithm: ClassVar[str] = "mtp"

    norm_output: bool = True
    target_config: dict = field(default_factory=dict)

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {"draft_vocab_size": vocab_size, "norm_output": bool(option(drafter, "norm_output", True)),
                "target_config": text_config_dict(hf_config)}

    @classmethod
    def from_target_config(cls, hf_config, drafter_cfg, aux_layer_ids=None) -> MtpSpec:
        """The spec of ``hf_config``'s MTP module; it reads the final normed state whatever aux ids capture uses."""
        return super().from_target_config(hf_config, drafter_cfg, [read_target(hf_config)[1].num_hidden_layers])

    def validate(self) -> None:
        """Not DrafterSpec's rules: those refuse aux id L, the one state this drafter reads, and check a drafter
        layer's widths where this one is the target's own layer."""
        L = self.target_num_hidden_layers
        if list(self.aux_layer_ids) != [L]:
            raise ValueError(f"an MTP drafter reads the target's final normed state, aux_layer_ids=[{L}]; got "
                             f"{self.aux_layer_ids}")
        if self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"an MTP drafter drafts over the target's whole vocab: draft_vocab_size="
                             f"{self.draft_vocab_size} != vocab_size={self.vocab_size}")
        model_type = self.target_config.get("model_type")
        if model_type not in DECODERS:
            raise ValueError(f"target model_type {model_type!r}: Fledge fine-tunes the MTP module of "
                             f"{sorted(DECODERS)} (vLLM's deepseek_mtp.py)")

    def module_config(self):
        """The transformers config the module is built from, its attention the drafter's (:data:`ATTENTION`)."""
        from transformers import AutoConfig

        c = {k: v for k, v in self.target_config.items() if not k.startswith("_")}
        config = AutoConfig.for_model(c.pop("model_type"), **c)
        config._attn_implementation = ATTENTION
        config._experts_implementation = "grouped_mm"  # what from_pretrained gives the target (eager where it can't)
        return config


class _Attend:
    """What a step hands the module's attention in place of a mask: ``fn(q, k, v, scaling) -> [B, Hq, T, Dv]``."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: a step's own attention, else (the module run on its own) sdpa's."""
    if isinstance(attention_mask, _Attend):
        return attention_mask.fn(query, key, value, scaling).transpose(1, 2), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, _attention)


def _scaled(q: torch.Tensor, scaling: float) -> torch.Tensor:
    """q pre-scaled so that attention applying ``D^-0.5`` applies MLA's ``scaling`` (yarn's mscale included)."""
    return q * (scaling * q.shape[-1] ** 0.5)


class MtpDrafter(DrafterModule):
    """The MTP module of an ``MtpSpec`` as a chain drafter: ``fuse`` (the final normed state, as it is), ``ttt_step``
    (training) and ``decode_step`` (engine-style, with a ``DraftCache``), as models/drafter.py's EAGLE drafter, so
    the TTT loss, the held-out accuracy, the in-process proposer and the drift probe run it unchanged."""

    def __init__(self, spec: MtpSpec, attention: str = "auto", norm_impl: str = "torch") -> None:
        super().__init__()
        spec.validate()
        resolve_attention(attention, torch.device("cpu"))  # name check only
        self.spec, self.attention = spec, attention
        config = spec.module_config()
        V, H = config.vocab_size, config.hidden_size
        embed = nn.Embedding(V, H).requires_grad_(False)  # the target's, frozen (vLLM shares it)
        head = nn.Linear(H, V, bias=False).requires_grad_(False)  # likewise
        self.layers = nn.ModuleDict({str(config.num_hidden_layers): MTPModule(config, embed, head)})
        self._inv_freq_fp32 = self.rotary_emb.inv_freq.detach().clone()
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool), persistent=False)  # every id is a draft id
        self._watch: Callable[[torch.Tensor], None] | None = None
        self.norm_impl = norm_impl

    @property
    def module(self) -> MTPModule:
        return next(iter(self.layers.values()))

    @property
    def rotary_emb(self) -> nn.Module:  # DrafterModule keeps its frequencies fp32 through dtype casts
        return self.module.rotary_emb

    @property
    def lm_head(self) -> nn.Linear:
        return self.module.shared_head.head

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.module.embed_tokens

    @torch.no_grad()
    def load_target(self, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy in the target's input embedding and lm_head ``[V, H]`` (both kept frozen)."""
        for have, given in ((self.embed_tokens.weight, embedding), (self.lm_head.weight, lm_head)):
            if given.shape != have.shape:
                raise ValueError(f"target weight {tuple(given.shape)} != {tuple(have.shape)}")
            have.copy_(given)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the draft vocab is the target's

    def watch_queries(self, keep: Callable[[torch.Tensor], None]) -> Callable[[], None]:
        """Hand ``keep`` each engine-path query as the attention scores it (``[B, Hq, S, D]``, RoPE and the softmax
        scale applied; evaluation/drift.py) until the returned function is called."""
        self._watch = keep

        def stop() -> None:
            self._watch = None

        return stop

    # ---- the forward, shared by both paths ---------------------------------------------------
    def fuse(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final normed state ``[B, T, Ht]`` (aux id L): what draft 1 reads, as it is."""
        if final_hidden.shape[-1] != self.spec.target_hidden_size:
            raise ValueError(f"the MTP module reads the target's final normed state, width "
                             f"{self.spec.target_hidden_size}; got {final_hidden.shape[-1]}")
        return final_hidden

    def _layer(self, input_ids, hidden, position_ids, attend, logits: bool = True):
        """One draft step of the module with ``attend`` as its attention: (out before shared_head.norm, logits, or
        None without ``logits``: training takes its loss in chunks, never the whole vocab's logits at once)."""
        if not logits:
            return self.module.layer_out(hidden, input_ids, position_ids, attention_mask=_Attend(attend)), None
        return self.module(hidden, input_ids=input_ids, position_ids=position_ids, attention_mask=_Attend(attend))

    def _fed(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The state the next step reads: y = shared_head.norm(out) with ``norm_output`` (vLLM 0.32), else out."""
        return y if self.spec.norm_output else out

    def ttt_step(self, input_ids, hidden, position_ids, mask, kv: list, distribute=None):
        """One training-time-test step over all rows (models/drafter.py ``Eagle3Drafter.ttt_step``): returns
        (y = shared_head.norm(out) for ``lm_head``, the state to feed back)."""
        assert distribute is None, "an MTP drafter trains without sequence parallelism (conf/schema.py)"
        impl = resolve_attention(self.attention, hidden.device)

        def attend(q, k, v, scaling):
            width = q.shape[-1]  # v padded to the qk width for the TTT paths, cut back after
            kv.append((k, F.pad(v, (0, width - v.shape[-1]))))
            return ttt_attention_over(_scaled(q, scaling), kv, mask, impl)[..., : v.shape[-1]]

        out, _ = self._layer(input_ids, hidden, position_ids, attend, logits=False)
        y = self.module.feedback(out)
        return y, self._fed(out, y)

    def decode_step(self, input_ids, hidden, position_ids, cache):
        """Engine-style step (``[B, S]`` ids and positions, ``[B, S, H]`` states; a ``DraftCache``): S > 1 is a
        prefill, S = 1 one draft. Returns (logits over the target's vocab ``[B, S, V]``, state to feed back)."""

        def attend(q, k, v, scaling):
            q = _scaled(q, scaling)
            if self._watch is not None:
                self._watch(q)
            k_all, v_all = cache.append(k, v)
            return cached_attention(q, k_all, v_all)

        out, logits = self._layer(input_ids, hidden, position_ids, attend)
        return logits, self._fed(out, self.module.feedback(out))


def _build(spec: MtpSpec, attention: str = "auto", norm_impl: str = "torch") -> MtpDrafter:
    return MtpDrafter(spec, attention=attention, norm_impl=norm_impl)


ALGORITHMS.register("mtp", Algorithm("mtp", MtpSpec, _build, vllm_method="mtp", block=False, target_head=True,
                                     title="MTP"))
