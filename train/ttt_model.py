"""The module DeepSpeed wraps: the drafter plus the frozen teacher head, forward = TTT loss.

Wrapping keeps every parameter access inside a submodule's forward, which is what ZeRO-3's
gather hooks need; the teacher head (draft-vocab rows of the target's lm_head) is a frozen,
non-persistent buffer, so checkpoints hold only the drafter (under the ``drafter.`` prefix).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from fledge.conf.schema import Config
from fledge.data.batch import FeatureBatch
from fledge.train.loss import TTTLoss, TTTResult, build_loss

log = logging.getLogger(__name__)


class TTTModel(nn.Module):
    """``forward(batch)`` = ``loss(drafter, batch, teacher_head)``: a ``TTTResult`` (train/loss.py)."""

    PREFIX = "drafter."

    def __init__(self, drafter: nn.Module, teacher_head: torch.Tensor, loss: TTTLoss) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("teacher_head", teacher_head, persistent=False)
        self.loss = loss

    def forward(self, batch: FeatureBatch) -> TTTResult:
        return self.loss(self.drafter, batch, self.teacher_head)

    def cast_teacher(self, dtype: torch.dtype) -> None:
        """DeepSpeed's bf16 mode casts parameters, not buffers: match the teacher head to the compute
        dtype once (its logits are upcast to fp32 before the softmax in the loss)."""
        self.teacher_head = self.teacher_head.to(dtype)


def drafter_meta(cfg: Config, spec) -> dict:
    """What export needs besides the weights of a drafter with ``spec``: the spec, the target and how the
    drafter was trained."""
    d = cfg.drafter
    return {
        "spec": spec.to_dict(),
        "target": {"name_or_path": cfg.target.name_or_path, "revision": cfg.target.revision},
        "training": {"recipe": cfg.recipe, "loss": d.loss, "ttt_steps": d.ttt_steps, "step_weight": d.step_weight,
                     "fc_norm": d.fc_norm, "norm_output": d.norm_output, "norm_before_fc": d.norm_before_fc,
                     "train": dataclasses.asdict(cfg.train)},
    }


def build_ttt_model(cfg: Config, run_dir: Path, device: torch.device) -> TTTModel:
    """Drafter from the target's config + the prepared draft vocab; embedding and teacher head from
    the target's weights (read directly, without instantiating the target)."""
    from transformers import AutoConfig

    from fledge.data.vocab import DraftVocab
    from fledge.models.drafter import DrafterSpec, Eagle3Drafter
    from fledge.models.weights import load_input_embeddings, load_lm_head_rows

    if cfg.drafter.norm_impl == "triton" and device.type != "cuda":
        raise ValueError(f"drafter.norm_impl=triton runs a CUDA kernel but training runs on {device.type}; "
                         "use drafter.norm_impl=torch")
    loss = build_loss(cfg.drafter)  # an unknown drafter.loss fails before any weight is read
    t = cfg.target
    hf_config = AutoConfig.from_pretrained(t.name_or_path, revision=t.revision, trust_remote_code=t.trust_remote_code)
    vocab = DraftVocab.load(run_dir / "prepare" / "vocab.safetensors")
    if len(vocab.d2t) != cfg.drafter.draft_vocab_size:
        raise ValueError(f"{run_dir / 'prepare'}: draft vocab has {len(vocab.d2t)} ids but "
                         f"drafter.draft_vocab_size={cfg.drafter.draft_vocab_size}; re-run prepare")
    spec = DrafterSpec.from_target_config(hf_config, cfg.drafter, cfg.aux_layer_ids())
    torch.manual_seed(cfg.run.seed)
    drafter = Eagle3Drafter(spec, attention=cfg.drafter.attention, norm_impl=cfg.drafter.norm_impl)
    embedding = load_input_embeddings(t.name_or_path, t.revision)
    teacher_head = load_lm_head_rows(t.name_or_path, t.revision, vocab.selected).float().contiguous()
    drafter.load_target_embedding(embedding)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        if spec.hidden_size == spec.target_hidden_size:
            # Warm start: the drafter's y plays the role of the target's final normed state.
            drafter.lm_head.weight.copy_(teacher_head)
    if cfg.drafter.init_from:
        from fledge.models.export import load_drafter

        loaded = load_drafter(cfg.drafter.init_from, embed_weight=embedding)
        drafter.load_state_dict(loaded.state_dict())
        log.info("initialised the drafter from %s", cfg.drafter.init_from)
    return TTTModel(drafter, teacher_head, loss).to(device)
