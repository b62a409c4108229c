"""DFlash's training part (models/dflash.py): the drafter over the prepare stage's draft vocab, or the target's whole
vocab when ``drafter.draft_vocab_size`` is its size (:func:`build`), and its objective over the shared feature batch
(arXiv 2602.06036; SpecForge's ``OnlineDFlashModel``; speculators' DFlash drafts over 32,000 ids by default).

Per packed row, up to ``num_anchors`` anchors a are drawn among the positions whose next token the target generates
(``loss_mask[a + 1]``, same document). Block j is ``[x_a, mask, ..., mask]`` (``block_size`` tokens at positions
pos_a .. pos_a + B - 1) and sees the context states of its document strictly before a (the anchor's own state does
not exist yet when the engine drafts) and its own block, bidirectionally (models/dflash.py ``block_mask``). Block
offset k (1..B-1) predicts the token at a + k: it is scored where that token is in the loss mask and the anchor's
document and the target's argmax there is in the draft vocab (as an EAGLE step's rows: the drafter cannot draft the
others), against the target's distribution at a + k - 1 (the state that predicted it: ``target_hidden`` through the
target's lm_head rows of the draft vocab, renormalised there). The formula is the registered ``drafter.loss``'s
``loss_sum`` (the soft CE by default: distillation from the frozen target, where the paper's CE reads the data's
tokens), and offset k weighs ``exp(-(k - 1) / gamma)`` (the paper's Eq. 4, ``drafter.position_decay``), each offset's
loss the mean over its rows of the whole optimizer step (train/losses/base.py ``step_denominators``), as the EAGLE steps
are.

Anchors are drawn by a generator seeded from the row's content, so that the trainer's row count before a step and
the forward agree; ``drafter.num_anchors`` bounds the block queries per row (N x B of them, each attending to the
row's T context keys and N x B block keys).

The block's layout and logits are the drafter's (models/dflash.py): a drafter whose anchor drafts (DSpark,
train/objectives/dspark.py) scores K = B slots, slot j against the target's distribution at a + j, and its logits
may read the token before the predicted one (the data's: teacher forcing). Every count and weight below is per
drafted slot j = offset j + 1.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fledge.data.features.batch import FeatureBatch
from fledge.data.prepare.vocab import DraftVocab
from fledge.models.algorithms import DrafterSpec, build_drafter
from fledge.models.alignment import step_key
from fledge.models.dflash import block_mask
from fledge.models.weights import load_input_embeddings, load_lm_head_rows
from fledge.stage_inputs import TrainInputs
from fledge.train.losses.base import TTTLoss, TTTResult, nonzero_denominators
from fledge.train.objectives.base import OBJECTIVES, Trainable

log = logging.getLogger(__name__)


class DFlashObjective:
    """``objective(drafter, batch, teacher_head)`` -> ``TTTResult`` with metrics ``loss_k``, ``acc_k``, ``full_acc_k``
    for the drafted slots k (block offsets k + 1, k = 0..K-1: K = B - 1 for DFlash, B when the anchor drafts), as
    the trainer reads the EAGLE steps'. ``loss``: the registered loss whose ``loss_sum`` scores each slot;
    ``teacher_head``: the target's lm_head rows of the draft vocab ``[Vd, Ht]``."""

    def __init__(self, loss: TTTLoss, *, block_size: int, num_anchors: int, position_decay: float,
                 chunk_size: int) -> None:
        if block_size < 2 or num_anchors < 1 or not position_decay > 0 or chunk_size < 1:
            raise ValueError(f"DFlash objective: block_size={block_size} (>= 2), num_anchors={num_anchors} (>= 1), "
                             f"position_decay={position_decay} (> 0), chunk_size={chunk_size} (>= 1)")
        self.loss, self.B, self.N, self.chunk = loss, block_size, num_anchors, chunk_size
        self.weights = [math.exp(-k / position_decay) for k in range(block_size)]  # drafted slot k (offset k + 1)

    @classmethod
    def from_config(cls, loss: TTTLoss, drafter_cfg) -> DFlashObjective:
        return cls(loss, block_size=drafter_cfg.block_size, num_anchors=drafter_cfg.num_anchors,
                   position_decay=drafter_cfg.position_decay, chunk_size=drafter_cfg.loss_chunk_size)

    # ---- which rows --------------------------------------------------------------------------------------
    def anchors(self, batch: FeatureBatch) -> list[torch.Tensor]:
        """Per row of the batch, its sorted anchor indices (CPU int64)."""
        out = []
        ids, mask, doc = (t.detach().cpu() for t in (batch.input_ids, batch.loss_mask, batch.document_ids))
        for b in range(ids.shape[0]):
            ok = (doc[b, :-1] >= 0) & (doc[b, 1:] == doc[b, :-1]) & mask[b, 1:]
            cand = ok.nonzero().flatten()
            seed = (int(ids[b].sum()) * 1_000_003 + int(cand.sum()) * 7919 + ids.shape[1]) % (1 << 62)
            g = torch.Generator().manual_seed(seed)
            out.append(cand[torch.randperm(len(cand), generator=g)[:self.N]].sort().values)
        return out

    def _labels(self, drafter, batch: FeatureBatch, b: int, a: torch.Tensor, K: int) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """(label positions ``[N, K]``, counted ``[N, K]``) of row b's anchors ``a`` (on the batch's device): a label
        counts inside the anchor's document, in the loss mask, and where the target's argmax is a draft-vocab id."""
        T = batch.input_ids.shape[1]
        dev = batch.loss_mask.device
        a = a.to(dev)
        p = a[:, None] + torch.arange(1, K + 1, device=dev)
        inside = p < T
        pc = p.clamp(max=T - 1)
        doc = batch.document_ids[b]
        counted = inside & (doc[pc] == doc[a][:, None]) & batch.loss_mask[b][pc]
        if not drafter.whole_vocab:
            counted &= drafter.t2d.to(dev)[batch.target_argmax[b][pc - 1]]
        return pc, counted

    def counted_rows(self, drafter, batch: FeatureBatch, shard=None) -> torch.Tensor:
        if shard is not None:
            raise ValueError("the DFlash objective runs without sequence parallelism (train.sequence_parallel=1)")
        counts = torch.zeros(drafter.drafts, dtype=torch.int64, device=batch.loss_mask.device)
        for b, a in enumerate(self.anchors(batch)):
            counts += self._labels(drafter, batch, b, a, drafter.drafts)[1].sum(0)
        return counts

    # ---- the forward -------------------------------------------------------------------------------------
    def __call__(self, drafter, batch: FeatureBatch, teacher_head: torch.Tensor, shard=None,
                 denominators: torch.Tensor | None = None) -> TTTResult:
        if shard is not None:
            raise ValueError("the DFlash objective runs without sequence parallelism (train.sequence_parallel=1)")
        if teacher_head.shape[0] != drafter.spec.draft_vocab_size:
            raise ValueError(f"teacher_head has {teacher_head.shape[0]} rows; the DFlash drafter drafts over "
                             f"{drafter.spec.draft_vocab_size} ids")
        K = drafter.drafts
        ys, ths, counted, argmax = [], [], [], []
        for b, a in enumerate(self.anchors(batch)):
            if not len(a):
                continue
            dev = batch.input_ids.device
            a = a.to(dev)
            ctx = drafter.context(batch.aux_hidden[b:b + 1])
            kv = drafter.context_kv(ctx, batch.position_ids[b:b + 1])
            ids, pos = drafter.block_inputs(batch.input_ids[b, a], batch.position_ids[b, a], K)
            L = ids.shape[1]
            mask = block_mask(a, batch.document_ids[b], L)[None, None]
            y = drafter.blocks(ids.reshape(1, -1), pos.reshape(1, -1), kv, mask).view(len(a), L, -1)[:, -K:]
            p, c = self._labels(drafter, batch, b, a, K)
            ys.append(drafter.head_input(y, batch.input_ids[b][p - 1]))  # the token before each predicted one
            ths.append(batch.target_hidden[b][p - 1])
            counted.append(c)
            argmax.append(batch.target_argmax[b][p - 1])
        dev = batch.aux_hidden.device
        total = torch.zeros((), dtype=torch.float32, device=dev)
        if not ys:  # no anchor in this micro-batch: a zero loss that still reaches every parameter
            total = total + 0.0 * sum(p.sum() for p in drafter.parameters() if p.requires_grad)
            ys = [drafter.head_input(torch.zeros(0, K, drafter.spec.hidden_size, device=dev),
                                     torch.zeros(0, K, dtype=torch.long, device=dev))]
            ths = [torch.zeros(0, K, teacher_head.shape[1], device=dev)]
            counted = [torch.zeros(0, K, dtype=torch.bool, device=dev)]
            argmax = [torch.zeros(0, K, dtype=torch.long, device=dev)]
        y, th, counted, argmax = torch.cat(ys), torch.cat(ths), torch.cat(counted), torch.cat(argmax)
        counts = counted.sum(0)
        if denominators is None:
            denominators = nonzero_denominators(counts)
        denominators = denominators.to(dev, torch.float32)
        right = torch.zeros_like(counted)
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        f64 = lambda x: x.detach().to(torch.float64)  # noqa: E731
        chain = torch.ones(counted.shape[0], dtype=torch.bool, device=dev)
        chain_scored = chain.clone()
        head = drafter.head_weight(teacher_head.float())  # the drafter's scoring head (DSpark's adds its Markov w2)
        for k in range(K):
            rows = counted[:, k].nonzero().flatten()
            s, pred = self._offset_sum(y[rows, k], th[rows, k], head, teacher_head)
            right[rows, k] = drafter.draft_to_target(pred) == argmax[rows, k]
            total = total + self.weights[k] * s / denominators[k]
            chain, chain_scored = chain & right[:, k], chain_scored & counted[:, k]
            metrics[step_key("loss", k)] = (f64(s), f64(counts[k]))
            metrics[step_key("acc", k)] = (f64(right[:, k].sum()), f64(counts[k]))
            metrics[step_key("full_acc", k)] = (f64((chain & chain_scored).sum()), f64(chain_scored.sum()))
        return TTTResult(loss=total, metrics=metrics)

    def _offset_sum(self, y: torch.Tensor, th: torch.Tensor, head: torch.Tensor,
                    teacher_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss of the drafter's rows ``y [R, H']`` (its ``head_input``) scored by ``head [V, H']`` against
        teacher states ``th [R, Ht]`` through ``teacher_head [V, Ht]``, and the drafter's argmax, in chunks of
        ``chunk`` rows whose [rows, V] logits are recomputed in backward rather than kept."""
        W, Wt = head.float(), teacher_head.float()
        total = y.new_zeros((), dtype=torch.float32)
        preds = []
        for s in range(0, y.shape[0], self.chunk):
            yc, tc = y[s:s + self.chunk], th[s:s + self.chunk]
            part = checkpoint(self._chunk_sum, yc, tc, W, Wt, use_reentrant=False) \
                if yc.requires_grad or W.requires_grad else self._chunk_sum(yc, tc, W, Wt)
            total = total + part
            with torch.no_grad():
                preds.append((yc.float() @ W.T).argmax(-1))
        pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=y.device)
        return total, pred

    def _chunk_sum(self, yc, tc, W, Wt):
        with torch.no_grad():
            teacher = tc.float() @ Wt.T
        return self.loss.loss_sum(yc.float() @ W.T, teacher)


def build(inputs: TrainInputs, hf_config: Any, loss: TTTLoss, vocab_path: Path) -> Trainable:
    """A DFlash drafter (models/dflash.py) over the draft vocab at ``vocab_path`` (the prepare stage's; unread when
    ``drafter.draft_vocab_size`` is the target's whole vocab): its frozen embedding and lm_head rows are the target's,
    the rows also the teacher's head; the objective is :class:`DFlashObjective` over ``loss``."""
    t, d = inputs.target, inputs.drafter
    spec = DrafterSpec.from_target_config(hf_config, d, list(inputs.aux_layer_ids))
    torch.manual_seed(inputs.seed)
    embedding = load_input_embeddings(t.name_or_path, t.revision)
    spec = dataclasses.replace(spec, mask_token_id=mask_token(spec, hf_config, embedding, d.mask_token_id))
    drafter = build_drafter(spec, norm_impl=d.norm_impl)
    rows = torch.arange(spec.vocab_size)
    if spec.draft_vocab_size < spec.vocab_size:
        vocab = DraftVocab.load(vocab_path)
        if len(vocab.d2t) != spec.draft_vocab_size:
            raise ValueError(f"{vocab_path}: draft vocab has {len(vocab.d2t)} ids but drafter.draft_vocab_size="
                             f"{spec.draft_vocab_size}; re-run prepare")
        drafter.set_vocab(vocab.d2t, vocab.t2d)
        rows = vocab.selected
    head = load_lm_head_rows(t.name_or_path, t.revision, rows).float().contiguous()
    drafter.load_target_head(embedding, head)
    return Trainable(drafter, head, DFlashObjective.from_config(loss, d))


def mask_token(spec: DrafterSpec, hf_config, embedding: torch.Tensor, given: int | None) -> int:
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


OBJECTIVES.register("dflash", build)
