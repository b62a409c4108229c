"""The module DeepSpeed wraps: the drafter plus the frozen teacher head, forward = TTT loss.

Wrapping keeps every parameter access inside a submodule's forward, which is what ZeRO-3's
gather hooks need; the teacher head (draft-vocab rows of the target's lm_head) is a frozen,
non-persistent buffer, so checkpoints hold only the drafter (under the ``drafter.`` prefix).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fledge.data.features.batch import FeatureBatch
from fledge.data.prepare.vocab import DraftVocab
from fledge.models.algorithms import DrafterSpec, algorithm_of, build_drafter
from fledge.models.drafter import Eagle3Drafter
from fledge.models.drafter_checkpoint import META, RECORD, DrafterCheckpoint
from fledge.models.weights import load_input_embeddings, load_lm_head_rows
from fledge.registry import Registry
from fledge.stage_inputs import TrainInputs
from fledge.train.losses import TTTLoss, TTTResult, build_loss, step_denominators
from fledge.train.losses.dflash import DFlashObjective
from fledge.train.sequence_parallel import RowShard

log = logging.getLogger(__name__)


class TTTModel(nn.Module):
    """``forward(batch)`` = ``loss(drafter, batch, teacher_head)``: a ``TTTResult`` (train/losses)."""

    PREFIX = "drafter."

    def __init__(self, drafter: nn.Module, teacher_head: torch.Tensor, loss: TTTLoss) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("teacher_head", teacher_head, persistent=False)
        self.loss = loss

    def forward(self, batch: FeatureBatch | RowShard, denominators: torch.Tensor | None = None) -> TTTResult:
        """A ``RowShard`` (train/sequence_parallel.py) is one rank's part of a row split over its group;
        ``denominators``: the optimizer step's, from :meth:`step_denominators` (None: ``batch`` is the
        whole step)."""
        if isinstance(batch, RowShard):
            return self.loss(self.drafter, batch.batch, self.teacher_head, shard=batch, denominators=denominators)
        return self.loss(self.drafter, batch, self.teacher_head, denominators=denominators)

    def step_denominators(self, batches: list[FeatureBatch | RowShard], divisor: float) -> torch.Tensor:
        """The loss denominators of one optimizer step whose micro-batches on this rank are ``batches`` (on
        any device; counted before they move to it), ``divisor`` the number of micro-batch losses the
        optimizer averages (train/deepspeed_setup.py ``gradient_divisor``); train/losses/base.py ``step_denominators``.
        Every rank calls it once per step, before the step's first forward."""
        counts = sum(self.loss.counted_rows(self.drafter, b.batch, shard=b) if isinstance(b, RowShard)
                     else self.loss.counted_rows(self.drafter, b) for b in batches)
        return step_denominators(counts, divisor)

    def cast_teacher(self, dtype: torch.dtype) -> None:
        """DeepSpeed's bf16 mode casts parameters, not buffers: match the teacher head to the compute
        dtype once (its logits are upcast to fp32 before the softmax in the loss)."""
        self.teacher_head = self.teacher_head.to(dtype)


def build_ttt_model(inputs: TrainInputs, vocab_path: Path, device: torch.device) -> TTTModel:
    """Drafter from the target's config + the prepared draft vocab (``vocab_path``, the prepare stage's);
    embedding and teacher head from the target's weights (read directly, without instantiating the target)."""
    from transformers import AutoConfig

    if inputs.drafter.norm_impl == "triton" and device.type != "cuda":
        raise ValueError(f"drafter.norm_impl=triton runs a CUDA kernel but training runs on {device.type}; "
                         "use drafter.norm_impl=torch")
    loss = build_loss(inputs.drafter)  # an unknown drafter.loss fails before any weight is read
    t = inputs.target
    hf_config = AutoConfig.from_pretrained(t.name_or_path, revision=t.revision, trust_remote_code=t.trust_remote_code)
    return OBJECTIVES.get(algorithm_of(inputs.drafter).name)(inputs, hf_config, loss, vocab_path, device)


def _build_eagle(inputs: TrainInputs, hf_config, loss: TTTLoss, vocab_path: Path, device: torch.device) -> TTTModel:
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
    return TTTModel(drafter, teacher_head, loss).to(device)


def _build_dflash(inputs: TrainInputs, hf_config, loss: TTTLoss, vocab_path: Path, device: torch.device) -> TTTModel:
    """A DFlash drafter (models/dflash.py) over the target's whole vocab (no draft vocab: ``vocab_path`` unread): its
    frozen embedding and lm_head are the target's, the lm_head also the teacher's head; the objective is
    train/losses/dflash.py's over ``loss``."""
    t, d = inputs.target, inputs.drafter
    spec = DrafterSpec.from_target_config(hf_config, d, list(inputs.aux_layer_ids))
    torch.manual_seed(inputs.seed)
    embedding = load_input_embeddings(t.name_or_path, t.revision)
    spec = dataclasses.replace(spec, mask_token_id=_dflash_mask_token(spec, hf_config, embedding, d.mask_token_id))
    drafter = build_drafter(spec, norm_impl=d.norm_impl)
    head = load_lm_head_rows(t.name_or_path, t.revision, torch.arange(spec.vocab_size)).float().contiguous()
    drafter.load_target_head(embedding, head)
    return TTTModel(drafter, head, DFlashObjective.from_config(loss, d)).to(device)


def _dflash_mask_token(spec: DrafterSpec, hf_config, embedding: torch.Tensor, given: int | None) -> int:
    """The token a DFlash block is filled with. Its embedding is the target's, frozen (vLLM embeds it with the
    target's table), and a zero row (a padding token's) makes every mask slot's query zero after the layer's norms:
    such slots attend uniformly and never learn where they are. So the default (the target's pad id) falls back to
    its eos id when the pad row is zero, and a given id with a zero row is refused."""
    norms = embedding.float().norm(dim=-1)
    zero = lambda i: float(norms[i]) <= 1e-6 * float(norms.median())  # noqa: E731
    if not zero(spec.mask_token_id):
        return spec.mask_token_id
    if given is None:
        config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        if isinstance(eos, int) and 0 <= eos < len(norms) and not zero(eos):
            log.info("drafter.mask_token_id: the target's pad token %d has a zero embedding; DFlash blocks are "
                     "filled with its eos token %d instead", spec.mask_token_id, eos)
            return eos
    raise ValueError(f"drafter.mask_token_id={spec.mask_token_id}: the target's embedding of that token is zero (a "
                     "padding row), so every mask slot of a DFlash block would have a zero query; set "
                     "drafter.mask_token_id to a token with a trained embedding (a rarely used special token)")


# Each algorithm's drafter and objective over the shared feature batch (models/algorithms.py names the algorithms):
# (the train stage's inputs, the target's config, the loss, the prepare stage's draft vocab path, device) -> the
# TTTModel to train.
OBJECTIVES: Registry[Callable[..., TTTModel]] = Registry("drafter.algorithm", "train/ttt_model.py")
OBJECTIVES.register("eagle", _build_eagle)
OBJECTIVES.register("peagle", _build_eagle)  # P-EAGLE's mask slots are the drafter's (models/alignment.py unrolls them)
OBJECTIVES.register("dflash", _build_dflash)


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
