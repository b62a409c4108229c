"""Each drafter layer kind (models/layers/) trained through the GPU's compiled flex attention: one TTT unroll
forward and backward equals the dense reference's (outputs and every gradient), for llama, qwen3 and mla
(whose q/k heads are 192 wide and v 128, padded to one width for the attention call).

Skipped without CUDA (tests/conftest.py). Run on a GPU machine: python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from fledge.conf.schema import DrafterConfig
from fledge.data.features.batch import FeatureBatch
from fledge.models.algorithms import DrafterSpec
from fledge.models.alignment import ttt_states
from fledge.models.drafter import Eagle3Drafter
from tests.helpers.models import target_config

pytestmark = pytest.mark.gpu


def _batch(T=300, H=32, seed=1):
    """Two rows on the GPU: row 0 packs two documents then padding, row 1 is one document (several flex blocks)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(2, T, dtype=torch.int32)
    doc[0, 120:], doc[0, T - 10:] = 1, -1
    pos = torch.cat([torch.arange(120), torch.arange(T - 130), torch.arange(10)])
    return FeatureBatch(input_ids=torch.randint(0, 50, (2, T), generator=g).cuda(),
                        loss_mask=(torch.rand(2, T, generator=g) > 0.2).cuda(),
                        aux_hidden=torch.randn(2, T, 3 * H, generator=g).cuda(),
                        target_hidden=torch.randn(2, T, H, generator=g).cuda(),
                        target_argmax=torch.randint(0, 40, (2, T), generator=g).cuda(),
                        position_ids=torch.stack([pos, torch.arange(T)]).cuda(), document_ids=doc.cuda())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mla"])
def test_flex_trains_each_layer_kind_like_the_dense_reference(kind):
    spec = DrafterSpec.from_target_config(target_config(), DrafterConfig(draft_vocab_size=40, layer=kind), [2, 3, 4])
    b = _batch()
    out, grads = {}, {}
    for impl in ("flex", "dense"):
        torch.manual_seed(0)
        d = Eagle3Drafter(spec, attention=impl).cuda()
        ys = torch.stack(ttt_states(d, b, 3))
        (ys * torch.linspace(-1, 1, ys.shape[-1], device="cuda")).sum().backward()
        out[impl] = ys.detach()
        grads[impl] = {n: p.grad for n, p in d.named_parameters() if p.grad is not None}
    assert _rel(out["flex"], out["dense"]) < 5e-3
    assert grads["flex"].keys() == grads["dense"].keys()
    for n in grads["dense"]:
        assert _rel(grads["flex"][n], grads["dense"][n]) < 5e-3, n
