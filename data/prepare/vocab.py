"""The draft vocabulary (docs/architecture.md, The draft vocabulary): the ``Vd`` target ids most frequent at
loss-masked positions.

``selected`` holds them in ascending order; ``d2t[i] = selected[i] - i`` (the offset engines add to a draft
id), ``t2d`` is a bool mask over the target vocab. Ties in frequency break toward the smaller id, and
when fewer than ``Vd`` ids were seen the rest is filled the same way (count 0, ascending id), so a map is
a pure function of (counts, Vd). On disk: a safetensors file (d2t, t2d, counts) beside a json whose ``key``
hashes the data, the tokenizer and Vd (the prepare stage's ``vocab.safetensors`` and ``vocab.json``,
fledge/run_layout.py); :func:`load_cached` refuses a map with another key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fledge.atomic import atomic_path, read_json, write_json_atomic


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [Vd]: target_id = i + d2t[i]
    t2d: torch.Tensor  # bool [V]: target id is in the draft vocab
    counts: torch.Tensor  # int64 [V]: occurrences at loss-masked positions

    @property
    def selected(self) -> torch.Tensor:
        """Target ids of the draft vocab, ascending (int64 [Vd])."""
        return self.d2t + torch.arange(len(self.d2t), dtype=torch.int64)

    @property
    def size(self) -> int:
        return len(self.d2t)

    def coverage(self) -> float:
        """Fraction of masked tokens whose target id is in the draft vocab."""
        total = int(self.counts.sum())
        return float(self.counts[self.t2d].sum()) / total if total else 0.0

    @classmethod
    def build(cls, counts: torch.Tensor | np.ndarray, Vd: int) -> DraftVocab:
        """Top-``Vd`` ids by count (ties and unseen ids: ascending id), per docs/architecture.md, The draft
        vocabulary."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
        V = len(counts)
        if not 1 <= Vd <= V:
            raise ValueError(f"draft vocab size {Vd} must be in [1, {V}] (the target's vocab size)")
        # Stable sort on -count keeps ascending id order within equal counts.
        order = torch.sort(-counts, stable=True).indices
        sel = torch.sort(order[:Vd]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[sel] = True
        return cls(d2t=sel - torch.arange(Vd, dtype=torch.int64), t2d=t2d, counts=counts)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous(), "counts": self.counts.contiguous()},
                      str(tmp))

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        from safetensors.torch import load_file

        t = load_file(str(path))
        missing = {"d2t", "t2d", "counts"} - set(t)
        if missing:
            raise ValueError(f"{path}: not a draft vocab file (missing {sorted(missing)})")
        v = cls(d2t=t["d2t"].to(torch.int64), t2d=t["t2d"].to(torch.bool), counts=t["counts"].to(torch.int64))
        if int(v.t2d.sum()) != v.size or not torch.equal(torch.nonzero(v.t2d).flatten(), v.selected):
            raise ValueError(f"{path}: d2t and t2d disagree; delete it to rebuild the draft vocab")
        return v


def count_masked(input_ids: list, loss_mask: list, vocab_size: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Add the ids at masked positions of one or many sequences to ``counts`` (int64 [V])."""
    counts = np.zeros(vocab_size, dtype=np.int64) if counts is None else counts
    ids = np.asarray(input_ids, dtype=np.int64).ravel()
    m = np.asarray(loss_mask, dtype=bool).ravel()
    sel = ids[m]
    if sel.size and (sel.min() < 0 or sel.max() >= vocab_size):
        raise ValueError(f"token id {int(sel.max())} outside the target vocab of {vocab_size}")
    counts += np.bincount(sel, minlength=vocab_size)
    return counts


def vocab_key(data_fingerprint: str, tokenizer_fingerprint: str, Vd: int) -> str:
    """The cache key of a draft vocab: a hash of the data, the tokenizer and Vd."""
    blob = json.dumps({"data": data_fingerprint, "tokenizer": tokenizer_fingerprint, "Vd": Vd}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides token ids: the vocab, the added tokens and the chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:20]


def load_cached(path: str | Path, meta_path: str | Path, key: str) -> DraftVocab | None:
    """The draft vocab saved at ``path`` if its key (in ``meta_path``) matches ``key``; None when absent or
    stale."""
    meta = read_json(meta_path)
    if not meta or meta.get("key") != key or not Path(path).exists():
        return None
    return DraftVocab.load(path)


def save_with_key(vocab: DraftVocab, path: str | Path, meta_path: str | Path, key: str,
                  extra: dict | None = None) -> dict:
    """Write the vocab to ``path`` and its key, Vd, V and coverage to ``meta_path``; returns that json."""
    vocab.save(path)
    meta = {"key": key, "draft_vocab_size": vocab.size, "vocab_size": len(vocab.t2d),
            "coverage": round(vocab.coverage(), 6), "masked_tokens": int(vocab.counts.sum()),
            "distinct_ids": int((vocab.counts > 0).sum()), **(extra or {})}
    write_json_atomic(meta_path, meta)
    return meta
