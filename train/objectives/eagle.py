"""EAGLE-3/3.1 and P-EAGLE's training part (models/eagle.py, models/peagle.py): the drafter over the prepare stage's
draft vocab, started from the target's embedding and the teacher's lm_head rows (or from a drafter checkpoint,
``drafter.init_from``), and the registered loss unrolled over the TTT steps (train/losses) as its objective."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fledge.data.prepare.vocab import DraftVocab
from fledge.models.algorithms import DrafterSpec
from fledge.models.drafter import Eagle3Drafter
from fledge.models.drafter_checkpoint import META, RECORD, DrafterCheckpoint
from fledge.models.weights import load_input_embeddings, load_lm_head_rows
from fledge.stage_inputs import TrainInputs
from fledge.train.losses import TTTLoss
from fledge.train.objectives.base import OBJECTIVES, Trainable

log = logging.getLogger(__name__)


def build(inputs: TrainInputs, hf_config: Any, loss: TTTLoss, vocab_path: Path) -> Trainable:
    """An EAGLE drafter (models/drafter.py) over the prepared draft vocab, its lm_head warm-started from the teacher's
    rows; the objective is ``loss`` unrolled over the TTT steps (train/losses)."""
    t, d = inputs.target, inputs.drafter
    vocab = DraftVocab.load(vocab_path)
    if len(vocab.d2t) != d.draft_vocab_size:
        raise ValueError(f"{vocab_path}: draft vocab has {len(vocab.d2t)} ids but "
                         f"drafter.draft_vocab_size={d.draft_vocab_size}; re-run prepare")
    spec = DrafterSpec.from_target_config(hf_config, d, list(inputs.aux_layer_ids))
    torch.manual_seed(inputs.seed)
    drafter = Eagle3Drafter(spec, attention=d.attention, norm_impl=d.norm_impl)
    embedding = load_input_embeddings(t.name_or_path, t.revision)
    teacher_head = load_lm_head_rows(t.name_or_path, t.revision, vocab.selected).float().contiguous()
    drafter.load_target_embedding(embedding)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        if spec.hidden_size == spec.target_hidden_size:
            # Warm start: the drafter's y plays the role of the target's final normed state.
            drafter.lm_head.weight.copy_(teacher_head)
    if d.init_from:
        init_from(drafter, d.init_from)
    return Trainable(drafter, teacher_head, loss)


OBJECTIVES.register("eagle", build)
OBJECTIVES.register("peagle", build)  # P-EAGLE's mask slots are the drafter's (models/alignment.py unrolls them)


# What a drafter to fine-tune must share with this run, as (config key, DrafterSpec field). The layer's
# shapes come from the target's config, so a mismatch there means another target too.
_SAME = (("drafter.algorithm", "algorithm"), ("drafter.aux_layer_ids", "aux_layer_ids"), ("drafter.fc_norm", "fc_norm"),
         ("drafter.norm_output", "norm_output"), ("drafter.norm_before_fc", "norm_before_fc"),
         ("target.vocab_size", "vocab_size"), ("target.hidden_size", "target_hidden_size"),
         ("the target's hidden_size (drafter width)", "hidden_size"),
         ("the target's intermediate_size", "intermediate_size"),
         ("the target's num_attention_heads", "num_attention_heads"),
         ("the target's num_key_value_heads", "num_key_value_heads"), ("the target's head_dim", "head_dim"))


@torch.no_grad()
def init_from(drafter: nn.Module, source: str | Path) -> None:
    """Start ``drafter`` (built for this run: its draft vocab installed, ``lm_head`` at its initial rows)
    from the drafter checkpoint at ``source`` (``drafter.init_from``: a run's ``train/best`` or a checkpoint's
    ``drafter/``, models/drafter_checkpoint.py).

    The run's vocab maps stay: the loaded ``lm_head`` rows move to the draft ids of the same target ids,
    and a target id the loaded drafter did not draft keeps this run's initial row (the teacher's row when
    the drafter is as wide as the target, as for a fresh drafter: the drafter's output plays the target's
    final normed state, so the target's own output row is the one prior that fits; else the default
    init). The embedding stays the target's. A drafter whose algorithm, aux ids, norm flags or target sizes
    differ from the run's is refused (ValueError naming the key): its weights would be silently wrong here."""
    loaded, tensors = _read_init_from(source)
    for key, field in _SAME:
        have, want = getattr(loaded, field), getattr(drafter.spec, field)
        if have != want:
            raise ValueError(f"drafter.init_from={source}: that drafter has {key}={have!r} but this run has "
                             f"{key}={want!r}; fine-tune only from a drafter of the same target and layout")
    both_parallel = loaded.parallel_drafting and drafter.spec.parallel_drafting
    if both_parallel and loaded.mask_token_id != drafter.spec.mask_token_id:
        raise ValueError(f"drafter.init_from={source}: that drafter's parallel slots were trained on mask token "
                         f"{loaded.mask_token_id} but this run has drafter.mask_token_id="
                         f"{drafter.spec.mask_token_id}; set drafter.mask_token_id={loaded.mask_token_id}")
    V = drafter.spec.vocab_size
    old_ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))  # target id of each loaded draft id
    new_ids = drafter.d2t.cpu() + torch.arange(len(drafter.d2t))
    old_row = torch.full((V,), -1, dtype=torch.int64)
    old_row[old_ids] = torch.arange(len(old_ids))
    src = old_row[new_ids]  # the loaded row of each of this run's draft ids, -1 where it has none
    kept = src >= 0
    head = drafter.lm_head.weight.detach().cpu().clone()
    head[kept] = tensors["lm_head.weight"][src[kept]].to(head.dtype)
    skip = {"d2t", "t2d", "embed_tokens.weight"} | ({"mask_hidden"} if not drafter.spec.parallel_drafting else set())
    state = {k: v for k, v in tensors.items() if k not in skip}
    state["lm_head.weight"] = head
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    # a P-EAGLE run started from a chain drafter keeps its own initial mask_hidden
    assert set(missing) - {"mask_hidden"} == {"d2t", "t2d", "embed_tokens.weight"} and not unexpected, (missing,
                                                                                                   unexpected)
    log.info("initialised the drafter from %s: %d of %d draft ids carry its lm_head rows, %d start from %s",
             source, int(kept.sum()), len(new_ids), int((~kept).sum()),
             "the teacher's rows" if drafter.spec.hidden_size == drafter.spec.target_hidden_size
             else "the default init")


def _read_init_from(source: str | Path) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    """The spec and state dict of the drafter checkpoint ``drafter.init_from`` names; ValueError, one line naming
    the key and the fix, for anything else (an export for serving is the trainer's output, not its input)."""
    d = Path(source)
    if not (d / META).is_file() and ((d / RECORD).is_file() or (d / "config.json").is_file()):
        raise ValueError(f"drafter.init_from={source}: an exported (serving) drafter directory; fine-tuning starts "
                         f"from a drafter checkpoint (with {META}): set drafter.init_from to the run's train/best "
                         "or train/checkpoints/step_<N>/drafter it was exported from")
    try:
        return DrafterCheckpoint.read(d).spec, DrafterCheckpoint.tensors(d)
    except ValueError as e:
        raise ValueError(f"drafter.init_from={source}: {e}") from None
