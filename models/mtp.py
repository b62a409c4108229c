"""DeepSeek-V3's multi-token prediction (MTP) module, as vLLM 0.32 serves it with ``method: mtp``
(model_executor/models/deepseek_mtp.py) and as its checkpoint stores it.

At slot t the module reads the target's final hidden state at t and the embedding of token t+1, and predicts
token t+2 (the DeepSeek-V3 report, section 2.2; ``fledge tiny-target mla_mtp`` trains it that way):

    e   = enorm(embed_tokens(token t+1)), zeroed where position == 0 (vLLM does: "not needed by MTP")
    x   = eh_proj([e, hnorm(h_t)])               # the embedding first, as vLLM concatenates it
    out = mtp_block(x, position t)               # one decoder layer of the target's kind, residual included
    logits = shared_head.head(shared_head.norm(out))

``h_t`` is the target's hidden state *after* its final norm (what its decoder returns and its lm_head reads:
vLLM hands the MTP the target model's output). Drafting k > 1 tokens, vLLM runs the same module again one
slot on, on the token it just drafted and on ``shared_head.norm(out)`` of the step before
(:meth:`MTPModule.feedback`; v1/spec_decode/llm_base_proposer.py, ``model_returns_tuple``), at the next position;
:func:`draft_chain` runs that chain.

The embedding and the output head are the target's own, shared (vLLM replaces the module's with the target's
at load, and DeepSeek trains them shared); the checkpoint still holds copies of both in the MTP layer, as
DeepSeek-V3's does. On disk the module is decoder layer ``num_hidden_layers`` of the target
(``model.layers.{N}.*``, beside ``num_nextn_predict_layers: 1`` in config.json): ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens`` and the decoder layer's own names
(no ``mtp_block.``; routed experts one tensor per expert, as transformers writes the target's layers).
:func:`checkpoint_tensors` and :func:`load_mtp` map between the two.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path

import torch
from torch import nn

from fledge.models.kernels.rmsnorm import RMSNorm

# model_type -> (transformers module, decoder layer class, rotary embedding class) of the targets whose MTP
# module vLLM's deepseek_mtp.py serves and transformers can build a decoder layer of.
DECODERS = {"deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3DecoderLayer",
                            "DeepseekV3RotaryEmbedding")}
# transformers keeps a layer's routed experts as two 3-D tensors; checkpoints hold one tensor per expert.
_FUSED = re.compile(r"^(.*mlp\.experts\.)(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")  # not the decoder layer's


def _decoder_classes(config):
    if config.model_type not in DECODERS:
        raise ValueError(f"model_type {config.model_type!r}: Fledge builds MTP modules for {sorted(DECODERS)} "
                         "(vLLM's deepseek_mtp.py)")
    module, layer, rotary = DECODERS[config.model_type]
    mod = importlib.import_module(module)
    return getattr(mod, layer), getattr(mod, rotary)


class SharedHead(nn.Module):
    """The MTP layer's final norm and output head (vLLM's ``shared_head``; the head is the target's)."""

    def __init__(self, hidden_size: int, eps: float, head: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.head = head


class MTPModule(nn.Module):
    """One MTP layer over a target (see the module docstring). ``config``: the target's transformers config
    (its text part; one without an attention implementation, as read from disk, gets transformers' sdpa and
    grouped_mm experts, what a model of it would run); ``embed_tokens`` and ``lm_head``: the target's modules,
    shared, not copied."""

    def __init__(self, config, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        layer_cls, rotary_cls = _decoder_classes(config)
        if getattr(config, "_attn_implementation", None) is None:  # read from disk, not a model's: pick as one does
            config = copy.deepcopy(config)
            config._attn_implementation, config._experts_implementation = "sdpa", "grouped_mm"
        H, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.layer_index = config.num_hidden_layers  # the MTP layer follows the decoder layers on disk
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        # vLLM builds the block as decoder layer N (an MoE one past first_k_dense_replace): the same here
        self.mtp_block = layer_cls(config, self.layer_index)
        self.shared_head = SharedHead(H, eps, lm_head)
        self.rotary_emb = rotary_cls(config=config)  # buffers only, none persistent
        self.init_weights(config.initializer_range)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Its own weights as transformers initialises the target's (the shared embedding and head untouched):
        norms at 1, every matrix (projections, experts, router) from N(0, std), the router's bias at 0."""
        for name, p in self.named_parameters():
            if name.startswith(("embed_tokens.", "shared_head.head.")):
                continue
            if p.dim() == 1:  # every 1-D parameter here is a norm's weight (no layer has a bias)
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states`` [B, T, H]: the target's final hidden state after its final norm at positions t
        (at a later draft step, :meth:`feedback` of the step before); ``input_ids`` [B, T]: token t+1 at slot t
        (or ``inputs_embeds`` [B, T, H] of it); ``position_ids`` [B, T]: t (default 0..T-1);
        ``attention_mask``: None for causal attention over the T slots, else a mask transformers' attention
        takes as it is. Returns (``out`` [B, T, H], the layer's output before ``shared_head.norm``; ``logits``
        [B, T, V] for token t+2)."""
        out = self.layer_out(hidden_states, input_ids, position_ids, inputs_embeds, attention_mask)
        return out, self.shared_head.head(self.shared_head.norm(out))

    def layer_out(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward`'s ``out`` alone, without the logits over the whole vocab (training takes its loss in
        chunks from ``shared_head.norm(out)``: at DeepSeek-V3's 129K vocab the logits of a 4K-token row are 1 GiB
        in bf16)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=inputs_embeds.device).expand(B, T)
        inputs_embeds = torch.where(position_ids.unsqueeze(-1) == 0, 0.0, inputs_embeds)
        x = self.eh_proj(torch.cat([self.enorm(inputs_embeds), self.hnorm(hidden_states)], dim=-1))
        if attention_mask is None:
            from transformers.masking_utils import create_causal_mask

            attention_mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                                past_key_values=None, position_ids=position_ids)
        return self.mtp_block(x, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=self.rotary_emb(x, position_ids))

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden state the next draft step reads in place of the target's: ``shared_head.norm(out)``."""
        return self.shared_head.norm(out)


@torch.no_grad()
def draft_chain(mtp: MTPModule, target_hidden: torch.Tensor, ids: list[int], k: int) -> list[int]:
    """k greedy drafts after ``ids`` (the context, its last token the target's latest), as vLLM's proposer
    chains the module: slots 0..n-1 read the target's hidden states ``target_hidden`` [n, H] (n = len(ids) - 1,
    after its final norm) and tokens 1..n; each further slot reads :meth:`MTPModule.feedback` of the slot before
    and the token just drafted, one position on. A full causal forward per draft stands in for vLLM's KV cache."""
    n = len(ids) - 1
    hidden, tokens, drafts = target_hidden[None, :n], list(ids[1:]), []
    for _ in range(k):
        out, logits = mtp(hidden, torch.tensor([tokens], device=hidden.device))
        drafts.append(int(logits[0, -1].argmax()))
        hidden = torch.cat([hidden, mtp.feedback(out[:, -1:])], dim=1)
        tokens.append(drafts[-1])
    return drafts


def checkpoint_tensors(mtp: MTPModule) -> dict[str, torch.Tensor]:
    """The module's tensors under the checkpoint's names (``model.layers.{N}.*``, see the module docstring),
    detached copies: the embedding and head copies included, each expert's projections apart."""
    out: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{mtp.layer_index}."
    for name, t in mtp.state_dict().items():
        name, t = name.removeprefix("mtp_block."), t.detach()
        if m := _FUSED.match(name):  # gate_up_proj [E, 2I, H] = per expert [gate; up]; down_proj [E, H, I]
            for e in range(t.shape[0]):
                if m.group(2) == "down_proj":
                    out[f"{prefix}{m.group(1)}{e}.down_proj.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}{m.group(1)}{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}{m.group(1)}{e}.up_proj.weight"] = up.clone()
        else:
            out[prefix + name] = t.clone()
    return out


def module_state_dict(tensors: dict[str, torch.Tensor], layer_index: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`checkpoint_tensors`: the checkpoint's ``model.layers.{layer_index}.*`` tensors
    under the module's names (the embedding and head copies left out: the module shares the target's)."""
    prefix = f"model.layers.{layer_index}."
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # stem -> projection -> expert -> tensor
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if name.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name if name.startswith(_OWN) else "mtp_block." + name] = t
    for stem, proj in experts.items():
        ids = sorted(proj["down_proj"])
        out[f"mtp_block.{stem}gate_up_proj"] = torch.stack([torch.cat([proj["gate_proj"][e], proj["up_proj"][e]])
                                                            for e in ids])
        out[f"mtp_block.{stem}down_proj"] = torch.stack([proj["down_proj"][e] for e in ids])
    return out


def load_mtp(target: str | Path, dtype: torch.dtype = torch.float32) -> MTPModule:
    """The MTP module of a local target checkpoint (``num_nextn_predict_layers`` >= 1), in ``dtype``, with the
    target's own embedding and output head as vLLM serves it (read from its files; not trainable)."""
    from transformers import AutoConfig

    from fledge.models.weights import input_embedding_name, lm_head_name, read_tensors, weight_map

    config = AutoConfig.from_pretrained(target)
    config = getattr(config, "text_config", None) or config
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError(f"{target}: config.json has no num_nextn_predict_layers: this target has no MTP module")
    names = weight_map(target)
    head = lm_head_name(names) or input_embedding_name(names)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = read_tensors(target, [n for n in names if n.startswith(prefix)]
                           + [input_embedding_name(names), head])
    embed = nn.Embedding.from_pretrained(tensors[input_embedding_name(names)].to(dtype))
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype).requires_grad_(False)
    lm_head.weight.data.copy_(tensors[head])
    mtp = MTPModule(config, embed, lm_head).to(dtype)
    state = module_state_dict(tensors, config.num_hidden_layers)
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    missing = [n for n in missing if not n.startswith(("embed_tokens.", "shared_head.head."))]
    if missing or unexpected:
        raise ValueError(f"{target}: the MTP layer {prefix}* does not match the module: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return mtp.eval()
