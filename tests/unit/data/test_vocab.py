"""Draft vocab per docs/architecture.md, The draft vocabulary: top-Vd by masked count, d2t offsets, t2d, caching by
key."""

import numpy as np
import pytest
import torch

from fledge.data.prepare.vocab import DraftVocab, count_masked, load_cached, save_with_key, vocab_key


def test_build_matches_spec():
    counts = count_masked([[5, 1, 5, 3, 9, 9, 9, 2]], [[1, 1, 1, 0, 1, 1, 1, 0]], 12)
    assert counts.tolist() == [0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0]  # masked positions only
    v = DraftVocab.build(counts, 2)
    assert v.selected.tolist() == [5, 9] and v.d2t.tolist() == [5, 8]
    assert v.t2d.nonzero().flatten().tolist() == [5, 9] and v.d2t.dtype == torch.int64
    assert v.coverage() == pytest.approx(5 / 6)
    # Vd beyond the ids seen: most frequent first, then ascending unseen ids.
    v = DraftVocab.build(counts, 5)
    assert v.selected.tolist() == [0, 1, 2, 5, 9]
    assert (v.selected == torch.arange(5) + v.d2t).all() and v.coverage() == 1.0
    # Ties break toward the smaller id.
    assert DraftVocab.build(np.array([2, 1, 2, 2]), 2).selected.tolist() == [0, 2]
    with pytest.raises(ValueError, match="must be in"):
        DraftVocab.build(counts, 13)


def test_save_load_and_key(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=100)
    v = DraftVocab.build(counts, 17)
    k = vocab_key("data-a", "tok", 17)
    path, meta_path = tmp_path / "v.safetensors", tmp_path / "v.json"
    meta = save_with_key(v, path, meta_path, k)
    assert meta["coverage"] == pytest.approx(v.coverage(), abs=1e-6)
    w = load_cached(path, meta_path, k)
    assert torch.equal(w.d2t, v.d2t) and torch.equal(w.t2d, v.t2d) and torch.equal(w.counts, v.counts)
    assert load_cached(path, meta_path, vocab_key("data-b", "tok", 17)) is None  # other data: stale
    assert load_cached(path, meta_path, vocab_key("data-a", "tok", 16)) is None  # other Vd: stale
    assert load_cached(path, meta_path, vocab_key("data-a", "tok2", 17)) is None  # other tokenizer: stale
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_masked([3, 200], [1, 1], 100)
