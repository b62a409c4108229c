"""Long rows (docs/long-context.md): capture in pieces through the target's KV cache gives the states of one
forward, with attention scores of [chunk, T] instead of [T, T] (checked on the score tensors themselves);
the eval harness's prefill keeps only the last row's logits, in pieces too."""

import pytest
import torch

from fledge.data.capture.offline import capture_rows
from fledge.models.target import FrozenTarget

L, H, V = 4, 64, 160


def _llama(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=256)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def eager():
    return _llama("eager")


def _score_sizes(model):
    """Record the (query, key) lengths of every layer's attention probabilities (eager returns them)."""
    seen = []

    def hook(_m, _args, out):
        seen.append(tuple(out[1].shape[-2:]))

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    return seen, handles


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_capture_equals_one_forward(attn):
    model = _llama(attn)
    target = FrozenTarget(model, [0, 2, 3])
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, V, (61,), generator=g).tolist(), torch.randint(1, V, (37,), generator=g).tolist()]
    one = list(capture_rows(target, rows))
    pieces = list(capture_rows(target, rows, chunk_tokens=16))  # 61 = 3 x 16 + 13; row 2 padded
    for (a1, f1, m1), (a2, f2, m2) in zip(one, pieces):
        torch.testing.assert_close(a2, a1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5)
        assert torch.equal(m2, m1)
    # negative control: a cache that forgot the earlier pieces gives other states after the first piece
    lost = torch.cat([target.capture(torch.tensor([rows[0][s:s + 16]]))[0][0] for s in range(0, 61, 16)])
    assert torch.allclose(lost[:16], one[0][0][:16], atol=1e-5)
    assert not torch.allclose(lost[16:], one[0][0][16:], atol=1e-3)


def test_chunked_capture_scores_are_chunk_by_T(eager):
    target = FrozenTarget(eager, [1, 3])
    x = torch.randint(0, V, (1, 96), generator=torch.Generator().manual_seed(2))
    seen, handles = _score_sizes(eager)
    try:
        target.capture(x)
        single = max(q * k for q, k in seen)
        seen.clear()
        target.capture(x, chunk_tokens=32)
        chunked = max(q * k for q, k in seen)
    finally:
        for h in handles:
            h.remove()
    assert single == 96 * 96  # the control: one forward scores [T, T]
    assert chunked == 32 * 96 and len(seen) == 3 * L  # the last piece: 32 queries over all 96 keys


def test_prefill_in_pieces_keeps_only_the_last_logits():
    from fledge.evaluation.speculative import TargetRunner

    model = _llama()
    prompt = torch.randint(0, V, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = []
    handle = model.lm_head.register_forward_hook(lambda _m, inp, _out: rows.append(inp[0].shape[-2]))
    try:
        whole = TargetRunner(model, [1, 3])
        ref_logits, ref_aux = whole.forward(prompt)
        assert rows == [50]  # the control: a plain forward makes [S, V] logits
        rows.clear()
        runner = TargetRunner(model, [1, 3], prefill_chunk=16)
        logits, aux = runner.prefill(prompt)
    finally:
        handle.remove()
    assert rows == [1, 1, 1, 1] and len(runner) == 50  # 4 pieces, one logits row each
    torch.testing.assert_close(logits, ref_logits[-1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-5)
    # decoding continues from the cache as after one forward
    nxt = [int(logits[-1].argmax())]
    torch.testing.assert_close(runner.forward(nxt)[0], whole.forward(nxt)[0], rtol=1e-5, atol=1e-5)
