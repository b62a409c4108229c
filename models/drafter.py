"""The EAGLE-3 / EAGLE-3.1 drafter (docs/architecture.md, The drafter): one module, two flags.

``Eagle3Drafter(spec)`` holds exactly the serving tensors (docs/serving.md, The export) under their un-prefixed
names (``fc.weight``, ``midlayer.self_attn.q_proj.weight``, ``lm_head.weight``, ``d2t``, ...), so export
maps its state_dict one to one. It runs in two ways that share every line of the layer math:

- ``ttt_step``: one training-time-test step over all T rows at once (train/losses unrolls K of them);
- ``decode_step``: an engine-style step with a KV cache (prefill then one draft token at a time).

Engine-style chain drafting, for the evaluation harness::

    cache = DraftCache()
    g = drafter.fuse(aux)                       # [B, S, n*Ht] target aux states -> [B, S, H]
    logits, g = drafter.decode_step(next_ids, g, positions, cache)   # next_ids[t] = x_{t+1}
    tok = logits[:, -1:].argmax(-1)             # draft id; drafter.draft_to_target(tok) -> target id
    for i in range(1, k):                       # feed back the state of the last row
        logits, g = drafter.decode_step(drafter.draft_to_target(tok), g[:, -1:], positions[:, -1:] + i, cache)
        tok = logits.argmax(-1)

``cache.crop(n)`` drops rejected entries before the next verification round.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from fledge.models.attention import cached_attention, resolve_attention, ttt_attention_over
from fledge.models.drafter_module import DrafterModule
from fledge.models.kernels.rmsnorm import RMSNorm
from fledge.models.layers.kind import get_layer_kind


class DraftCache:
    """Per-layer KV cache of an engine-style draft: keys/values ``[B, Hkv, L, D]`` after RoPE."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries (drop rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class _MidLayer(nn.Module):
    """The one decoder layer (docs/architecture.md, The drafter), with the attention supplied by the caller."""

    def __init__(self, spec, config: LlamaConfig) -> None:
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.hidden_norm = RMSNorm(H, eps=eps)
        self.self_attn = get_layer_kind(spec.layer).attention(spec)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, emb, g, cos, sin, attend):
        """``attend(q, k, v) -> [B, Hq, T, D]``; returns h2 ``[B, T, H]``."""
        z = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # embedding half first
        q, k, v = self.self_attn.project(z, cos, sin)
        h1 = g + self.self_attn.output(attend(q, k, v))  # residual around the raw g
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class Eagle3Drafter(DrafterModule):
    """EAGLE-3 (flags off) / EAGLE-3.1 (``fc_norm`` + ``norm_output``) drafter for a Llama-like target, of an
    ``EagleSpec`` (models/eagle.py) or a P-EAGLE ``PEagleSpec`` (models/peagle.py: ``mask_hidden`` added).

    ``attention`` selects the TTT attention (auto | flex | sdpa | dense; see models/attention.py) and
    may be changed on the instance; the engine path always uses a plain cached SDPA. ``norm_impl``
    selects every RMSNorm's implementation (torch | triton; see models/kernels/rmsnorm.py), likewise.
    """

    def __init__(self, spec, attention: str = "auto", norm_impl: str = "torch") -> None:
        super().__init__()
        spec.validate()
        resolve_attention(attention, torch.device("cpu"))  # name check only
        self.spec, self.attention = spec, attention
        H, Ht, eps = spec.hidden_size, spec.target_hidden_size, spec.rms_norm_eps
        config = spec.layer_config()
        self.embed_tokens = nn.Embedding(spec.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, eps=eps) for _ in spec.aux_layer_ids)
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(spec.fc_in_features, eps=eps)
        self.fc = nn.Linear(spec.fc_in_features, H, bias=False)
        self.midlayer = _MidLayer(spec, config)
        self.norm = RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
        if spec.parallel_drafting:  # P-EAGLE's slot state, in the aux states' space (vLLM's mask_hidden [1, n*Ht])
            self.mask_hidden = nn.Parameter(torch.randn(1, spec.fc_in_features))
        self.init_rope(config)
        self.init_vocab(spec.draft_vocab_size, spec.vocab_size)  # the first ids until set_vocab
        self.register_load_state_dict_pre_hook(self._check_fc_width)
        self.norm_impl = norm_impl

    # ---- setup -------------------------------------------------------------------------------
    @torch.no_grad()
    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy in the target's input embedding ``[V, H]`` (kept frozen)."""
        if weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embedding {tuple(weight.shape)} != {tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(weight)

    def _check_fc_width(self, module, state_dict, prefix, *args, **kwargs):
        w = state_dict.get(prefix + "fc.weight")
        if w is not None and w.shape[-1] != self.spec.fc_in_features:
            raise ValueError(
                f"fc.weight has {w.shape[-1]} input features but drafter.aux_layer_ids="
                f"{self.spec.aux_layer_ids} x target_hidden_size={self.spec.target_hidden_size} "
                f"needs {self.spec.fc_in_features}"
            )

    # ---- the forward, shared by both paths ---------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target aux states ``[B, T, n*Ht]`` (id order) -> step-0 feature g ``[B, T, H]``."""
        if aux_hidden.shape[-1] != self.spec.fc_in_features:
            raise ValueError(
                f"aux_hidden has width {aux_hidden.shape[-1]}; drafter.aux_layer_ids={self.spec.aux_layer_ids} "
                f"x target_hidden_size={self.spec.target_hidden_size} = {self.spec.fc_in_features}"
            )
        if self.spec.fc_norm:
            parts = aux_hidden.split(self.spec.target_hidden_size, dim=-1)
            aux_hidden = torch.cat([n(a) for n, a in zip(self.fc_norm, parts)], dim=-1)
        elif self.spec.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        return self.fc(aux_hidden)

    def parallel_inputs(self, like_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A parallel-drafting slot's inputs shaped like ``like_ids`` ``[B, T]``: the mask token's ids and
        ``fuse(mask_hidden)`` ``[B, T, H]``, as vLLM feeds every draft position after the first."""
        ids = torch.full_like(like_ids, self.spec.mask_token_id)
        g = self.fuse(self.mask_hidden.to(self.fc.weight.dtype)[None])
        return ids, g.expand(*like_ids.shape, g.shape[-1])

    def _layer(self, input_ids, g, position_ids, attend):
        """One draft step: returns (y = norm(h2), fed-back state)."""
        cos, sin = self.rotary_emb(g, position_ids)
        h2 = self.midlayer(self.embed_tokens(input_ids), g, cos, sin, attend)
        y = self.norm(h2)
        return y, (y if self.spec.norm_output else h2)

    def ttt_step(self, input_ids, hidden, position_ids, mask, kv: list, distribute=None):
        """One training-time-test step over all rows (docs/architecture.md, Training-time test).

        ``input_ids``/``position_ids`` ``[B, T]`` are this step's (already shifted) tokens and RoPE
        positions, ``hidden`` ``[B, T, H]`` is g (``fuse`` at step 0, the fed-back state after),
        ``mask`` the batch's ``TTTMask`` (models/attention.py; one per unroll, shared by its steps) or its
        document ids ``[B, T]``, ``kv`` the (k, v) of the earlier steps, to which this step's are appended.
        Row t attends to step-0 keys 0..t of its document and to its own key of each step >= 1.
        Returns (y ``[B, T, H]`` for ``lm_head``, the state to feed back).

        ``distribute`` (sequence parallelism; None on one rank): ``distribute(attend) -> attend'``, where
        ``attend(q, k, v)`` is this single-rank attention over ``[B, heads, T, D]`` tensors; the caller's
        wrapper may hand it other shapes (e.g. all rows of a head shard, with ``mask`` built for those rows),
        and ``kv`` then holds what the wrapper handed in. The drafter knows nothing else of it.
        """
        impl = resolve_attention(self.attention, hidden.device)

        def attend(q, k, v):
            kv.append((k, v))
            return ttt_attention_over(q, kv, mask, impl)

        return self._layer(input_ids, hidden, position_ids, attend if distribute is None else distribute(attend))

    def decode_step(self, input_ids, hidden, position_ids, cache: DraftCache):
        """Engine-style step: ``[B, S]`` ids, ``[B, S, H]`` states, ``[B, S]`` positions.

        S > 1 is a prefill (causal among the S rows, after everything in ``cache``); S = 1 is one draft
        token. Step 0 takes ``fuse(aux)``; later steps take the returned state (y if norm_output, else
        h2). Returns (logits over the draft vocab ``[B, S, Vd]``, state to feed back ``[B, S, H]``).
        All rows of the batch share one cache length (pad prompts to one length, or use B = 1).
        """

        def attend(q, k, v):
            k_all, v_all = cache.append(k, v)
            return cached_attention(q, k_all, v_all)

        y, nxt = self._layer(input_ids, hidden, position_ids, attend)
        return self.lm_head(y), nxt
