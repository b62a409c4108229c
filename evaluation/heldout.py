"""Teacher-forced held-out accuracy: the drafter's per-step accuracy on the held-out conversations, and the
offline estimate it gives beside the acceptance measured by decoding.

Natural text read teacher-forced, so loops in the target's own outputs cannot inflate it; unrolled up to 2K steps
(``eval.heldout_steps``), beyond the trained K too. A chain drafter (EAGLE) unrolls the training-time test
(models/alignment.py); a block drafter (``Algorithm.block``, models/algorithms.py) scores one block per anchor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fledge.models import alignment
from fledge.models.algorithms import algorithm_of
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.models.target import FrozenTarget
from fledge.progress import progress

Samples = Sequence[tuple[list[int], list[int]]]  # (token ids, loss mask) per held-out conversation

# Held-out rows are one length per run (below): flex attention is compiled with static shapes, one compile
# per key length (J + 1) T, and a row length per sample recompiled it for every sample (silently falling back
# to the eager kernel, which materialises the scores, past dynamo's limit).
HELDOUT_MIN_ROW = 128  # flex's sparse block size


def heldout_row_length(longest: int) -> int:
    """The row length of a held-out run: the smallest power of two >= ``longest`` and >= HELDOUT_MIN_ROW, so
    that runs of similar data share it too (a handful of lengths in all)."""
    return max(HELDOUT_MIN_ROW, 1 << max(0, longest - 1).bit_length())


def pack_heldout(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Sample indices per row, in order, each row holding samples whose lengths add up to <= ``row_len``."""
    rows: list[list[int]] = []
    used = row_len
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(f"held-out sample {i} has {n} tokens; row length {row_len}")
        if used + n > row_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


@torch.inference_mode()
def heldout_accuracy(drafter: nn.Module, frozen: FrozenTarget, samples: Samples, steps: int,
                     chunk_tokens: int = 0) -> dict:
    """{"steps", "acc", "full_acc", "rows"}: per-step accuracy of ``drafter`` on ``samples`` over ``steps`` draft
    steps, read by its algorithm's kind (below); ``chunk_tokens``: the capture's chunking of the target's forward.
    A block drafter is scored on its trained block, ``steps`` or fewer: a longer block changes what every slot
    attends to (the block is bidirectional), and an engine never serves one (vLLM caps k at the block)."""
    if algorithm_of(drafter.spec).block:
        return block_heldout_accuracy(drafter, frozen, samples, min(steps, drafter.drafts), chunk_tokens)
    return chain_heldout_accuracy(drafter, frozen, samples, steps, chunk_tokens)


BLOCK_ANCHORS = 128  # anchors per held-out block forward


@torch.inference_mode()
def block_heldout_accuracy(drafter: nn.Module, frozen: FrozenTarget, samples: Samples, steps: int,
                           chunk_tokens: int = 0) -> dict:
    """``heldout_accuracy`` of a block drafter (models/dflash.py): a block drafting ``steps`` tokens after every
    anchor a whose next token the target generates (its ``block_inputs``), drafted slot k scored where x_{a+k} is in
    the loss mask, against the target's argmax at a + k - 1 (its logits reading x_{a+k-1} as the token before);
    ``full_acc[j]`` over anchors whose slots 1..j+1 are all scored, right when all are."""
    from fledge.models.dflash import block_mask

    hit, full, rows = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    full_rows = torch.zeros(steps)
    dev = drafter.lm_head.weight.device
    for ids, mask in progress(samples, desc="held-out accuracy", leave=False):
        x = torch.tensor([ids], device=frozen.device)
        a_all, _, am = frozen.capture(x, chunk_tokens=chunk_tokens)
        T = len(ids)
        m = torch.tensor(mask, dtype=torch.bool, device=dev)
        am, x = am[0].to(dev), x[0].to(dev)
        kv = drafter.context_kv(drafter.context(a_all.to(dev, drafter.lm_head.weight.dtype)),
                                torch.arange(T, device=dev)[None])
        doc = torch.zeros(T, dtype=torch.int32, device=dev)
        anchors = (m[1:]).nonzero().flatten()
        for s in range(0, len(anchors), BLOCK_ANCHORS):
            a = anchors[s:s + BLOCK_ANCHORS]
            bids, pos = drafter.block_inputs(x[a], a, steps)
            B = bids.shape[1]
            y = drafter.blocks(bids.reshape(1, -1), pos.reshape(1, -1), kv, block_mask(a, doc, B)[None, None])
            p = a[:, None] + torch.arange(1, steps + 1, device=dev)
            pc = p.clamp(max=T - 1)
            pred = drafter.draft_to_target(drafter.logits(y.view(len(a), B, -1)[:, -steps:], x[pc - 1]).argmax(-1))
            scored = (p < T) & m[pc]
            ok = (pred == am[pc - 1]) & scored
            hit += ok.sum(0).float().cpu()
            rows += scored.sum(0).float().cpu()
            full += ok.cumprod(1).sum(0).float().cpu()
            full_rows += scored.cumprod(1).sum(0).float().cpu()
    acc = (hit / rows.clamp_min(1)).tolist()
    full_acc = (full / full_rows.clamp_min(1)).tolist()
    return {"steps": steps, "acc": acc, "full_acc": full_acc, "rows": rows.tolist()}


@torch.inference_mode()
def chain_heldout_accuracy(drafter: nn.Module, frozen: FrozenTarget, samples: Samples, steps: int,
                           chunk_tokens: int = 0) -> dict:
    """Teacher-forced per-step accuracy on held-out conversations (one document each), unrolled ``steps``
    TTT steps, beyond the trained K too. Step j's inputs and scored rows are training's
    (models/alignment.py): a row whose teacher argmax lies outside the draft vocab is a miss, as it is when
    drafting. ``full_acc[j]`` counts, among step j's scored rows, those whose steps 0..j were all right:
    this is the offline side of the offline-vs-measured comparison. ``rows[j]``: step j's scored rows.

    The target reads each conversation alone; the drafter reads them packed as documents into rows of one
    length (``heldout_row_length``; padding is document -1 and never counts), which the TTT mask keeps
    apart, so the numbers are those of one conversation per row."""
    hit, full, rows = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    dev, dtype = drafter.lm_head.weight.device, drafter.lm_head.weight.dtype
    if not samples:
        return {"steps": steps, "acc": [0.0] * steps, "full_acc": [0.0] * steps, "rows": rows.tolist()}
    R = heldout_row_length(max(len(ids) for ids, _ in samples))
    for members in progress(pack_heldout([len(ids) for ids, _ in samples], R), desc="held-out accuracy", leave=False):
        x = torch.zeros(1, R, dtype=torch.long, device=dev)
        argmax, aux = torch.zeros_like(x), None
        m = torch.zeros(1, R, dtype=torch.bool, device=dev)
        doc = torch.full((1, R), -1, dtype=torch.int32, device=dev)
        pos = torch.zeros(1, R, dtype=torch.long, device=dev)
        at = 0
        for d, i in enumerate(members):
            ids, mask = samples[i]
            n = len(ids)
            a, _, am = frozen.capture(torch.tensor([ids], device=frozen.device), chunk_tokens=chunk_tokens)
            if aux is None:
                aux = torch.zeros(1, R, a.shape[-1], dtype=dtype, device=dev)
            sl = slice(at, at + n)
            x[0, sl], argmax[0, sl], aux[0, sl] = torch.tensor(ids, device=dev), am[0].to(dev), a[0].to(dev, dtype)
            m[0, sl], doc[0, sl] = torch.tensor(mask, dtype=torch.bool, device=dev), d
            pos[0, sl] = torch.arange(n, device=dev)
            at += n
        all_ok = torch.ones(1, R, dtype=torch.bool, device=dev)
        for j, y in enumerate(alignment.unroll(drafter, aux, x, pos, doc, steps)):
            step = alignment.step_rows(m, doc, argmax, drafter.t2d, j)
            ok = drafter.draft_to_target(drafter.lm_head(y).argmax(-1)) == step.teacher_argmax
            all_ok &= ok
            hit[j] += float((ok & step.scored).sum())
            full[j] += float((all_ok & step.scored).sum())
            rows[j] += float(step.scored.sum())
    acc = (hit / rows.clamp_min(1)).tolist()
    full_acc = (full / rows.clamp_min(1)).tolist()
    return {"steps": steps, "acc": acc, "full_acc": full_acc, "rows": rows.tolist()}


def offline_vs_measured(report: dict) -> dict:
    """The held-out estimate per position beside the acceptance measured in process on the default set (else the
    first set)."""
    first = "default" if "default" in report["sets"] else next(iter(report["sets"]))
    measured = report["sets"][first]["drafter"]["accept_at"]
    offline = StepAccuracy(report["heldout"]["acc"][:len(measured)], report["heldout"]["full_acc"][:len(measured)])
    return {"set": first, "offline_full_acc": offline.full_acc, "measured_accept_at": measured,
            "gap": [m - o for m, o in zip(measured, offline.full_acc)], "offline_al": al_estimate(offline),
            "measured_al": report["sets"][first]["drafter"]["al"]}
