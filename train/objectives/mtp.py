"""The MTP drafter's training part (models/mtp_drafter.py): the target's own MTP module, started from its weights in
the target's checkpoint, trained with training-time test over K steps on the captured states, chained as vLLM 0.32
chains it.

- The module reads, at draft 1, the target's final normed state (the feature batch's ``target_hidden``: aux id L),
  so the objective is the registered TTT loss (train/losses) run on the batch with that state as its aux states;
  every later step reads the state the step before fed back (``drafter.norm_output``: shared_head.norm(out), as
  vLLM 0.32 feeds it, or out) and the real next token, at one position more (models/alignment.py).
- The embedding and the output head are the target's, frozen (vLLM shares them: a trained copy would be dropped at
  load), and the teacher head is the target's whole lm_head (the draft vocab is the target's vocab).
- Only the module trains: enorm, hnorm, eh_proj, the decoder layer (its experts and router too) and shared_head.norm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fledge.data.features.batch import FeatureBatch
from fledge.models.mtp import module_state_dict
from fledge.models.mtp_drafter import MtpDrafter, MtpSpec
from fledge.models.weights import load_input_embeddings, load_lm_head_rows, read_tensors, resolve_file, weight_map
from fledge.stage_inputs import TrainInputs
from fledge.train.losses import TTTLoss, TTTResult
from fledge.train.objectives.base import OBJECTIVES, Trainable

_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, loaded apart (load_target)


class MtpObjective:
    """The registered TTT loss over an MTP drafter whose draft 1 reads the target's final normed state
    (train/objectives/base.py ``Objective``)."""

    def __init__(self, loss: TTTLoss) -> None:
        self.loss = loss

    def __call__(self, drafter: nn.Module, batch: FeatureBatch, teacher_head: torch.Tensor, shard: Any = None,
                 denominators: torch.Tensor | None = None) -> TTTResult:
        assert shard is None, "an MTP drafter trains without sequence parallelism (conf/schema.py)"
        return self.loss(drafter, final_state_batch(batch), teacher_head, denominators=denominators)

    def counted_rows(self, drafter: nn.Module, batch: FeatureBatch, shard: Any = None) -> torch.Tensor:
        return self.loss.counted_rows(drafter, batch)


def final_state_batch(batch: FeatureBatch) -> FeatureBatch:
    """``batch`` with the target's final normed state as its aux states: what the MTP module's draft 1 reads."""
    return dataclasses.replace(batch, aux_hidden=batch.target_hidden)


@torch.no_grad()
def load_target_module(drafter: MtpDrafter, source: str | Path, revision: str | None = None) -> None:
    """Set the drafter's module to the target's own (its checkpoint's ``model.layers.{L}.*``, models/mtp.py's names),
    the embedding and head copies aside. ValueError naming the target when it has no MTP layer or another one."""
    L = drafter.spec.target_num_hidden_layers
    prefix = f"model.layers.{L}."
    names = [n for n in weight_map(source, revision) if n.startswith(prefix)]
    if not names:
        raise ValueError(f"drafter.algorithm=mtp fine-tunes the target's own MTP module, but {source} holds no "
                         f"{prefix}* tensors (its config's num_nextn_predict_layers="
                         f"{drafter.spec.target_config.get('num_nextn_predict_layers')}); use a target that ships "
                         "its MTP layer, or drafter=eagle31")
    if any(n.endswith("_scale_inv") for n in names):
        raise ValueError(f"{source}: its MTP layer is quantized ({prefix}*weight_scale_inv: DeepSeek's FP8 release); "
                         "fine-tune from the bf16 checkpoint (dequantized, as capture loads it)")
    state = module_state_dict(read_tensors(source, names, revision), L)
    dtype = drafter.module.eh_proj.weight.dtype
    missing, unexpected = drafter.module.load_state_dict({n: t.to(dtype) for n, t in state.items()}, strict=False)
    missing = [n for n in missing if n not in _SHARED]
    if missing or unexpected:
        raise ValueError(f"{source}: its MTP layer {prefix}* does not match the module its config describes "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")


def build(inputs: TrainInputs, hf_config: Any, loss: TTTLoss, vocab_path: Path) -> Trainable:
    """The target's MTP module as a drafter over its whole vocab (``vocab_path`` unread), started from the target's
    own weights; the objective is ``loss`` on the module's TTT unroll (:class:`MtpObjective`)."""
    t, d = inputs.target, inputs.drafter
    config = resolve_file(t.name_or_path, "config.json", t.revision)  # as shipped: the export writes it back
    spec = MtpSpec.from_target_config(json.loads(config.read_text()) if config else hf_config, d)
    torch.manual_seed(inputs.seed)
    drafter = MtpDrafter(spec, attention=d.attention, norm_impl=d.norm_impl)
    head = load_lm_head_rows(t.name_or_path, t.revision, torch.arange(spec.vocab_size)).float().contiguous()
    drafter.load_target(load_input_embeddings(t.name_or_path, t.revision), head)
    load_target_module(drafter, t.name_or_path, t.revision)
    return Trainable(drafter, head, MtpObjective(loss))


OBJECTIVES.register("mtp", build)
