"""The DFlash block drafter (arXiv 2602.06036), as vLLM 0.32 serves it (``DFlashQwen3ForCausalLM``).

One forward drafts a whole block. Its queries are ``[bonus token, mask, ..., mask]`` (``block_size`` tokens at
absolute positions P..P+B-1, the masks ``spec.mask_token_id`` embedded with the target's frozen table); block offset
k >= 1 predicts the token *at its own position* P+k. The target's states at the aux layers, concatenated, make the
context: ``ctx = hidden_norm(fc(aux))``, projected by every drafter layer's own ``k_proj``/``v_proj`` (k through
``k_norm`` and RoPE at the context positions) into keys and values the block attends to, with no causal mask inside
the block. Each layer is a pre-norm Qwen3 layer (q/k norms); the output goes through ``norm`` and ``lm_head``, the
target's rows of the draft vocab (``spec.draft_vocab_size`` ids, mapped to target ids by ``d2t`` as an EAGLE
drafter's are; the whole vocab when it equals the target's), frozen. The state_dict's names are the export's
(``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*``, ``norm.weight``); ``embed_tokens`` is a frozen copy of the
target's, never exported (vLLM shares the target's), and so is a whole-vocab ``lm_head``; a draft vocab's
``lm_head`` rows and ``d2t`` / ``t2d`` are exported (vLLM 0.32 reads ``draft_vocab_size``, the rows and ``d2t``).

- training (train/objectives/dflash.py): ``blocks`` over many anchors of a packed row at once, each block seeing the
  context of its own document strictly before its anchor (``block_mask``);
- drafting (evaluation/speculative.py ``BlockProposer``): ``context_kv`` of the verified positions, kept per layer
  and appended to, then ``propose`` of one block.

What a block drafter built on this one may change (models/dspark.py's DSpark does): whether the anchor's own slot drafts
(``anchor_drafts``: then a block of B tokens drafts B, else B - 1), and the logits of the drafting slots (``logits``,
and its factored form ``head_input`` / ``head_weight`` the training loss scores in chunks), with ``propose`` picking
the block's tokens. Training, the held-out accuracy and the proposer build blocks through ``block_inputs`` and read
the last ``drafts`` slots, so they serve both.

The aux states are the boundary convention's (docs/architecture.md, Aux layer ids): boundary id b is the output of
0-based layer b - 1, which is what DFlash's ``target_layer_ids`` name (``serving_layer_ids``).

``DFlashSpec`` is its spec (models/spec.py); the module registers the algorithm ``dflash`` (vLLM's method
``dflash``, a block drafter scoring with the target's lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, apply_rotary_pos_emb

from fledge.models.drafter_module import DrafterModule
from fledge.models.families import TargetFamily
from fledge.models.kernels.rmsnorm import RMSNorm
from fledge.models.layers.kind import LayerKind, get_layer_kind
from fledge.models.spec import ALGORITHMS, Algorithm, DrafterSpec, check_mask_token, mask_token_id_for, option


@dataclass
class DFlashSpec(DrafterSpec):
    """A DFlash drafter: ``num_draft_layers`` Qwen3 layers over blocks of ``block_size`` tokens, the slots after the
    bonus token filled with ``mask_token_id``, drafting over ``draft_vocab_size`` of the target's ids (all of them
    when it equals ``vocab_size``)."""

    algorithm: ClassVar[str] = "dflash"

    mask_token_id: int | None = None
    num_draft_layers: int = 1
    block_size: int = 16

    @classmethod
    def layer_kind(cls, family: TargetFamily, drafter: Any) -> LayerKind:
        return get_layer_kind("qwen3")  # whatever the target (vLLM's DFlashQwen3ForCausalLM)

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        return {"draft_vocab_size": int(option(drafter, "draft_vocab_size", vocab_size)),
                "mask_token_id": mask_token_id_for(drafter, hf_config, vocab_size),
                "num_draft_layers": int(option(drafter, "num_draft_layers", 1)),
                "block_size": int(option(drafter, "block_size", 16))}

    def _validate_own(self) -> None:
        check_mask_token(self, "a DFlash block is filled with")
        if self.block_size < 2 or self.num_draft_layers < 1 or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"a DFlash spec needs block_size >= 2 (has {self.block_size}), num_draft_layers >= 1 "
                             f"(has {self.num_draft_layers}) and 1 <= draft_vocab_size <= vocab_size (has "
                             f"{self.draft_vocab_size}, {self.vocab_size})")


def serving_layer_ids(aux_layer_ids) -> list[int]:
    """Boundary ids -> DFlash's ``target_layer_ids`` (the 0-based layer whose output is taken; vLLM adds 1 back)."""
    return [int(b) - 1 for b in aux_layer_ids]


def aux_layer_ids_of(target_layer_ids) -> list[int]:
    """DFlash's ``target_layer_ids`` -> boundary ids."""
    return [int(t) + 1 for t in target_layer_ids]


class _Attention(nn.Module):
    def __init__(self, spec) -> None:
        super().__init__()
        H, D = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, eps=spec.rms_norm_eps)
        self.k_norm = RMSNorm(D, eps=spec.rms_norm_eps)

    def _split(self, x, n):
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def kv(self, x, cos, sin):
        """``x [B, T, H]`` -> k (normed, rotated), v ``[B, Hkv, T, D]``."""
        k = self.k_norm(self._split(self.k_proj(x), self.kv_heads))
        k = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Block ``x [B, Q, H]`` attends to ``[ctx_k | its own keys]`` under ``mask`` (bool ``[B, 1, Q, C + Q]``, or
        None: everything)."""
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        k, v = self.kv(x, cos, sin)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        B, _, Q, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Layer(nn.Module):
    def __init__(self, spec, config) -> None:
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.self_attn = _Attention(spec)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(DrafterModule):
    """A DFlash drafter of a ``DFlashSpec``."""

    def __init__(self, spec: DFlashSpec, norm_impl: str = "torch") -> None:
        super().__init__()
        spec.validate()
        if not isinstance(spec, DFlashSpec):
            raise ValueError(f"DFlashDrafter needs a dflash spec, got algorithm={spec.algorithm!r}")
        self.spec = spec
        H, V, Vd, eps = spec.hidden_size, spec.vocab_size, spec.draft_vocab_size, spec.rms_norm_eps
        config = spec.layer_config()
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(spec.fc_in_features, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList(_Layer(spec, config) for _ in range(spec.num_draft_layers))
        self.norm = RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen
        self.init_rope(config)
        # a draft vocab's map is the drafter's (checkpointed, exported); the whole vocab's is the identity
        self.init_vocab(Vd, V, persistent=Vd < V)
        self.norm_impl = norm_impl

    @property
    def whole_vocab(self) -> bool:
        """Whether it drafts over the target's whole vocab (then its lm_head is the target's and never exported)."""
        return self.spec.draft_vocab_size == self.spec.vocab_size

    @torch.no_grad()
    def load_target_head(self, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy in the target's input embedding ``[V, H]`` and its lm_head rows of the draft vocab ``[Vd, H]`` (the
        rows at ``draft_to_target(arange(Vd))``, in that order), both kept frozen."""
        for name, have, w in (("embedding", self.embed_tokens.weight, embedding), ("lm_head", self.lm_head.weight,
                                                                                  lm_head)):
            if w.shape != have.shape:
                raise ValueError(f"target {name} {tuple(w.shape)} != the drafter's {tuple(have.shape)}")
            have.copy_(w)

    # ---- the forward, shared by training and drafting ------------------------------------------------------
    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target aux states ``[B, T, n*Ht]`` -> context states ``[B, T, H]`` (``hidden_norm(fc(aux))``)."""
        if aux_hidden.shape[-1] != self.spec.fc_in_features:
            raise ValueError(f"aux_hidden has width {aux_hidden.shape[-1]}; drafter.aux_layer_ids="
                             f"{self.spec.aux_layer_ids} x target_hidden_size={self.spec.target_hidden_size} = "
                             f"{self.spec.fc_in_features}")
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (k, v) ``[B, Hkv, T, D]`` of context states ``ctx [B, T, H]`` at ``positions [B, T]``."""
        cos, sin = self.rotary_emb(ctx, positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, block_ids, block_positions, ctx_kv, mask) -> torch.Tensor:
        """Block tokens ``[B, Q]`` at ``block_positions [B, Q]`` over the context's per-layer ``ctx_kv`` under
        ``mask`` (bool ``[B, 1, Q, C + Q]``, True = attend; None = all) -> normed states ``[B, Q, H]`` for
        ``lm_head``."""
        h = self.embed_tokens(block_ids)
        cos, sin = self.rotary_emb(h, block_positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    # ---- what a block drafter built on this one changes (module docstring) -----------------------------------
    anchor_drafts: ClassVar[bool] = False  # DFlash: the anchor (bonus) slot drafts nothing; its masks draft

    @property
    def drafts(self) -> int:
        """Tokens one trained block drafts: ``block_size - 1`` (DFlash), ``block_size`` when the anchor drafts."""
        return self.spec.block_size - 1 + int(self.anchor_drafts)

    def block_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, drafts: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """Blocks drafting ``drafts`` tokens after anchor ``tokens [N]`` at ``positions [N]``: ids and positions
        ``[N, L]``, the anchor then ``L - 1`` masks (L = ``drafts`` + 1, or ``drafts`` when the anchor drafts). The
        drafting slots are the last ``drafts``; slot j of them predicts the token at anchor position + 1 + j."""
        L = drafts + 1 - int(self.anchor_drafts)
        ids = torch.full((tokens.shape[0], L), self.spec.mask_token_id, dtype=torch.long, device=tokens.device)
        ids[:, 0] = tokens
        return ids, positions[:, None] + torch.arange(L, device=tokens.device)

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits of drafting slots' states ``h [..., H]`` whose previous tokens are ``prev [...]`` (the token just
        before each predicted one; DFlash does not read it)."""
        return self.lm_head(h)

    def head_input(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``logits`` factored for the training loss: ``head_input(h, prev) @ head_weight(lm_head).T``."""
        return h

    def head_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        return lm_head

    def propose(self, bonus: torch.Tensor, position: torch.Tensor, ctx_kv, k: int,
                pick=lambda logits: logits.argmax(-1)) -> tuple[torch.Tensor, torch.Tensor]:
        """One block as vLLM drafts it: ``bonus [B]`` at ``position [B]`` then masks, over the verified context
        ``ctx_kv`` (every position before ``position``) -> (tokens ``[B, k]``, logits ``[B, k, V]``) for positions
        +1..+k, target ids, and their logits over the draft vocab ``[B, k, Vd]``; ``pick`` (logits ``[..., Vd]`` ->
        draft ids) chooses the tokens: every slot at once, none feeds another."""
        ids, pos = self.block_inputs(bonus, position, k)
        logits = self.logits(self.blocks(ids, pos, ctx_kv, None)[:, -k:], None)
        return self.draft_to_target(pick(logits)), logits

    def draft(self, bonus: torch.Tensor, position: torch.Tensor, ctx_kv, k: int) -> torch.Tensor:
        """The logits ``[B, k, Vd]`` of the greedy block ``propose`` drafts."""
        return self.propose(bonus, position, ctx_kv, k)[1]


def block_mask(anchors: torch.Tensor, document_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The training mask of one packed row: ``anchors [N]`` (row indices), ``document_ids [T]`` ->
    bool ``[N * block_size, T + N * block_size]``: block j's tokens see the context positions of the anchor's
    document strictly before the anchor, and every token of block j (bidirectional), nothing else."""
    T, N = document_ids.shape[0], anchors.shape[0]
    t = torch.arange(T, device=anchors.device)
    ctx = (t[None] < anchors[:, None]) & (document_ids[None] == document_ids[anchors][:, None])  # [N, T]
    own = torch.eye(N, dtype=torch.bool, device=anchors.device)  # [N, N]
    ctx = ctx.repeat_interleave(block_size, 0)
    own = own.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return torch.cat([ctx, own], 1)


def _build(spec: DFlashSpec, attention: str = "auto", norm_impl: str = "torch") -> DFlashDrafter:
    return DFlashDrafter(spec, norm_impl=norm_impl)  # a block attends with plain SDPA: no attention choice


ALGORITHMS.register("dflash", Algorithm("dflash", DFlashSpec, _build, vllm_method="dflash", block=True,
                                        target_head=True, title="DFlash",
                                        rounds="a block of k={k} drafts in one drafter forward"))
