"""Small drafters, targets, batches and state dicts for tests of mechanics that need no trained model."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from fledge.conf.schema import DrafterConfig
from fledge.data.features.batch import FeatureBatch
from fledge.models.algorithms import DrafterSpec, build_drafter
from fledge.models.dflash import DFlashDrafter
from fledge.models.drafter import Eagle3Drafter

FLAGS = {
    "eagle3": dict(fc_norm=False, norm_output=False),
    "eagle31": dict(fc_norm=True, norm_output=True),
    "norm_before_fc": dict(fc_norm=False, norm_output=False, norm_before_fc=True),
}


def target_config(**rope):
    return LlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6,
        vocab_size=50, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )


def make_drafter(seed=0, attention="sdpa", **flags):
    torch.manual_seed(seed)
    spec = DrafterSpec.from_target_config(target_config(), DrafterConfig(draft_vocab_size=40, **flags), [2, 3, 4])
    d = Eagle3Drafter(spec, attention=attention)
    with torch.no_grad():  # non-trivial norm weights so a skipped norm is visible
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name or "input_norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def packed_batch(seed=1, T=19, H=32, n_aux=3):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 9 + [1] * 8 + [-1] * 2, [0] * T])
    pos = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        for t in range(1, T):
            pos[b, t] = pos[b, t - 1] + 1 if doc[b, t] == doc[b, t - 1] else 0
    B = doc.shape[0]
    return FeatureBatch(
        input_ids=torch.randint(0, 50, (B, T), generator=g),
        loss_mask=torch.rand(B, T, generator=g) > 0.2,
        aux_hidden=torch.randn(B, T, n_aux * H, generator=g),
        target_hidden=torch.randn(B, T, H, generator=g),
        target_argmax=torch.randint(0, 40, (B, T), generator=g),
        position_ids=pos,
        document_ids=doc.int(),
    )


def random_llama(seed=0, vocab_size=96):
    """An untrained 6-layer Llama (hidden 32, GQA) for speculative-decoding mechanics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def random_drafter(target, norm_output=True, seed=1, vd=64, layer="auto"):
    """An Eagle3Drafter (layer kind ``layer``) with random weights (norms too) and a random draft vocab of ``vd``
    ids."""
    v = target.config.vocab_size
    flags = SimpleNamespace(fc_norm=norm_output, norm_output=norm_output, norm_before_fc=False, draft_vocab_size=vd,
                            layer=layer)
    spec = DrafterSpec.from_target_config(target.config, flags, [2, 3, 4])
    torch.manual_seed(seed)
    d = Eagle3Drafter(spec)
    for p in d.parameters():  # random weights everywhere, norms included
        if p.requires_grad:
            p.data.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    sel = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[sel] = True
    d.set_vocab(sel - torch.arange(vd), t2d)
    d.load_target_embedding(target.get_input_embeddings().weight.detach())
    return d.eval()


def random_state_dict(config: dict, seed: int = 0, include_embed: bool = True) -> dict[str, torch.Tensor]:
    """A random fp32 drafter state_dict (drafter names) matching an exported config.json of any dialect,
    with a valid random draft vocab: exercises export, lint and load without a trained drafter."""
    from fledge.serving.export import from_serving_state_dict
    from fledge.serving.serving_config import expected_tensors, layer_config

    g = torch.Generator().manual_seed(seed)
    c = layer_config(config)
    V, Vd = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
    floats = {name: torch.randn(shape, generator=g) * 0.05
              for name, (shape, dtype) in expected_tensors(config, include_embed=include_embed).items()
              if dtype.is_floating_point}
    sd = from_serving_state_dict(floats)
    sel = torch.randperm(V, generator=g)[:Vd].sort().values
    sd["d2t"] = sel - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    sd["t2d"] = t2d
    return sd


# A small Llama target config and drafter settings for the model-card and Hub tests.
CARD_TARGET = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "vocab_size": 256, "rope_theta": 10000.0,
}
CARD_SPEC = DrafterSpec.from_target_config(CARD_TARGET, DrafterConfig(draft_vocab_size=64), [2, 3, 4])


# a DFlash drafter over a Llama-shaped target config (hidden 64, 8 layers, vocab 300)
DFLASH_TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 8,
    "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "pad_token_id": 0,
    "eos_token_id": 5}


def dflash_cfg(**kw):
    base = dict(algorithm="dflash", block_size=4, num_draft_layers=2, draft_vocab_size=300, fc_norm=False,
                norm_output=False, norm_before_fc=False, parallel_drafting=False, mask_token_id=None, layer="auto")
    return SimpleNamespace(**{**base, **kw})


def random_dflash(seed=0, **kw) -> DFlashDrafter:
    """A random DFlash drafter of DFLASH_TARGET (vocab 300, hidden 64); with ``draft_vocab_size`` < 300 its draft vocab
    is a random sorted selection of the target's ids, its lm_head those rows of the random target head."""
    spec = DrafterSpec.from_target_config(DFLASH_TARGET, dflash_cfg(**kw), [2, 4, 5])
    torch.manual_seed(seed)
    d = build_drafter(spec)
    for p in d.parameters():
        if p.requires_grad and p.dim() == 1:
            p.data.normal_(1.0, 0.1)  # random norms too
    load_block_head(d, torch.randn(300, 64), torch.randn(300, 64) * 0.2, seed)
    return d.eval()


def load_block_head(d, embedding: torch.Tensor, head: torch.Tensor, seed: int = 0) -> None:
    """Give block drafter ``d`` the target's ``embedding`` and ``head`` (both ``[V, H]``): over a draft vocab smaller
    than V, a random sorted selection of the target's ids installed as its vocab map and those rows as its lm_head."""
    V, Vd = d.spec.vocab_size, d.spec.draft_vocab_size
    sel = torch.arange(V)
    if Vd < V:
        sel = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 7))[:Vd].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[sel] = True
        d.set_vocab(sel - torch.arange(Vd), t2d)
    d.load_target_head(embedding, head[sel])


def random_dspark(seed=0, **kw) -> DFlashDrafter:
    """``random_dflash``'s drafter as DSpark (models/dspark.py: blocks of 3 drafting 3, Markov rank 8), its Markov
    head scaled up to change the drafts."""
    d = random_dflash(seed, **{"algorithm": "dspark", "block_size": 3, "markov_rank": 8, **kw})
    with torch.no_grad():
        d.markov_head.markov_w1.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed + 1))
    return d


def block_batch(seed=0, T=30) -> FeatureBatch:
    """A one-row feature batch of two documents and 3 padding slots (hidden 64, vocab 300): the block drafters'
    objective tests' input (DFlash, DSpark)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 12 + [1] * 15 + [-1] * 3])
    pos = torch.zeros_like(doc)
    for t in range(1, T):
        pos[0, t] = pos[0, t - 1] + 1 if doc[0, t] == doc[0, t - 1] else 0
    return FeatureBatch(input_ids=torch.randint(0, 300, (1, T), generator=g),
                        loss_mask=(torch.rand(1, T, generator=g) > 0.3) & (doc >= 0),
                        aux_hidden=torch.randn(1, T, 3 * 64, generator=g),
                        target_hidden=torch.randn(1, T, 64, generator=g),
                        target_argmax=torch.randint(0, 300, (1, T), generator=g),
                        position_ids=pos, document_ids=doc.int())
