"""Speculative decoding harness: greedy output identical to plain greedy decoding (random drafter, an
oracle that drafts the true continuation with corruptions, prompt lookup); the drafter's incremental cache
equals a fresh prefill; rejection sampling is lossless (chi-square against the exact distribution, with a
negative control that the test must reject)."""

import math

import pytest
import torch

import fledge.evaluation.speculative as spec_mod
from fledge.evaluation.speculative import (
    DrafterProposer,
    LookupProposer,
    TargetRunner,
    greedy_decode,
    speculative_decode,
    verify,
)
from tests.helpers.models import random_drafter, random_llama

V, VD = 96, 64


@pytest.fixture(scope="module")
def target():
    return random_llama()


PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 7], [3, 3, 60, 2, 44, 81, 17, 17, 17, 90, 2, 44]]


class OracleProposer:
    """Drafts the true greedy continuation, corrupting each draft with probability ``noise``."""

    needs_aux = False

    def __init__(self, ref, prompt_len, noise, seed=0):
        self.ref, self.p, self.noise = ref, prompt_len, noise
        self.g = torch.Generator().manual_seed(seed)

    def reset(self):
        pass

    def observe(self, next_tokens, aux):
        pass

    def propose(self, history, k, temperature=0.0, generator=None):
        start = len(history) - self.p
        out = list(self.ref[start:start + k])
        return [t if float(torch.rand((), generator=self.g)) >= self.noise else (t + 1) % V for t in out], None


def test_greedy_identical_with_random_drafter(target):
    drafter = random_drafter(target)
    runner, plain = TargetRunner(target, drafter.spec.aux_layer_ids), TargetRunner(target)
    prop = DrafterProposer(drafter)
    for prompt in PROMPTS:
        ref, _ = greedy_decode(plain, prompt, 30)
        res = speculative_decode(runner, prop, prompt, 4, 30)
        assert res.tokens == ref
        assert len(res.tokens) == 30
        assert all(1 <= r.emitted <= r.drafted + 1 for r in res.rounds)
        assert sum(r.emitted for r in res.rounds) + 1 == len(res.tokens)  # + the prefill's token


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_greedy_identical_with_oracle_drafts_and_eos(target, noise):
    plain = TargetRunner(target)
    prompt = PROMPTS[1]
    ref, _ = greedy_decode(plain, prompt, 40)
    eos = ref[23]
    ref_eos, _ = greedy_decode(plain, prompt, 40, eos_ids=[eos])
    assert ref_eos[-1] == eos and len(ref_eos) <= 24
    res = speculative_decode(TargetRunner(target), OracleProposer(ref, len(prompt), noise), prompt, 5, 40, [eos])
    assert res.tokens == ref_eos
    full = [r for r in res.rounds if not r.budget_limited and eos not in res.tokens[:-1]]
    if noise == 0.0:  # perfect drafts: every full round accepts all k (AL = k + 1) until the end token
        assert all(r.accepted == 5 for r in res.rounds[:-1]) and res.rounds
    else:
        assert any(0 < r.accepted < 5 for r in full) or any(r.accepted == 0 for r in full)


def test_prompt_lookup(target):
    lk = LookupProposer(max_ngram=3)
    assert lk.propose([1, 2, 3, 4, 1, 2], 3)[0] == [3, 4, 1]
    assert lk.propose([7, 8, 9, 1, 2, 9, 1, 2], 2)[0] == [9, 1]  # the longest match
    assert lk.propose([9, 1, 2, 4, 9, 1, 2, 5, 9, 1, 2], 2)[0] == [4, 9]  # the earliest, as vLLM's ngram picks
    assert lk.propose([5] * 8, 3)[0] == [5, 5, 5]  # a loop: k tokens, not the one behind the tail
    assert lk.propose([1, 2, 3], 4)[0] == []
    plain = TargetRunner(target)
    for prompt in PROMPTS:
        ref, _ = greedy_decode(plain, prompt, 25)
        res = speculative_decode(TargetRunner(target), lk, prompt, 3, 25)
        assert res.tokens == ref


def test_drafter_cache_matches_fresh_prefill(target):
    """After several verify/rollback rounds, the drafter's next drafts equal a fresh prefill's."""
    drafter = random_drafter(target, seed=3)
    runner = TargetRunner(target, drafter.spec.aux_layer_ids)
    prop = DrafterProposer(drafter)
    prompt = PROMPTS[0]
    res = speculative_decode(runner, prop, prompt, 3, 17)
    drafts_inc, _ = prop.propose(prompt + res.tokens, 3)
    seq = prompt + res.tokens
    fresh_runner = TargetRunner(target, drafter.spec.aux_layer_ids)
    _, aux = fresh_runner.forward(seq[:-1])
    fresh = DrafterProposer(drafter)
    fresh.observe(seq[1:], aux)
    drafts_fresh, _ = fresh.propose(seq, 3)
    assert prop.n == fresh.n == len(seq) - 1
    torch.testing.assert_close(prop.last_logits, fresh.last_logits, atol=1e-4, rtol=1e-4)
    assert drafts_inc == drafts_fresh


# ------------------------------------------------------------------------------ rejection sampling
def _chi2_critical(df, z=3.09):
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: alpha = 1e-3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, probs, n):
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    mask = exp > 0
    stat = float(((obs[mask] - exp[mask]) ** 2 / exp[mask]).sum())
    return stat, int(mask.sum()) - 1


def _always_accept(drafts, q, logits, temperature=0.0, generator=None):
    p = torch.softmax(logits / temperature, -1)
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def test_verify_first_token_marginal_is_target():
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 5, 3, 4000
    logits = torch.randn(k + 1, vocab, generator=g)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 2, -1)
    p0 = torch.softmax(logits[0], -1)
    for fn, should_pass in ((verify, True), (_always_accept, False)):
        counts = torch.zeros(vocab)
        gen = torch.Generator().manual_seed(1)
        for _ in range(n):
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
            acc, nxt = fn(drafts, q, logits, 1.0, gen)
            counts[(drafts[:acc] + [nxt])[0]] += 1
        stat, df = _chi2(counts, p0, n)
        assert (stat < _chi2_critical(df)) == should_pass, (fn.__name__, stat, df)


class MarkovTarget:
    """A TargetRunner stand-in whose next-token distribution depends on the last token only."""

    def __init__(self, logp):
        self.logp, self.seq = logp, []

    def reset(self):
        self.seq = []

    def __len__(self):
        return len(self.seq)

    def forward(self, ids):
        self.seq += list(ids)
        return self.logp[torch.tensor(self.seq[-len(ids):])], None

    def prefill(self, ids):
        return self.forward(ids)[0][-1:], None

    def crop(self, n):
        self.seq = self.seq[:n]


class MarkovDrafter:
    needs_aux = False

    def __init__(self, q):
        self.q = q

    def reset(self):
        pass

    def observe(self, next_tokens, aux):
        pass

    def propose(self, history, k, temperature=1.0, generator=None):
        last, drafts, qs = history[-1], [], []
        for _ in range(k):
            qs.append(self.q[last])
            last = int(torch.multinomial(self.q[last], 1, generator=generator))
            drafts.append(last)
        return drafts, torch.stack(qs)


def test_speculative_sampling_is_lossless_over_three_tokens(monkeypatch):
    """The joint law of the first 3 generated tokens equals the target's, through multi-token rounds and
    rollback; accepting every draft (negative control) is rejected by the same test."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 4, 4000
    P = torch.softmax(torch.randn(vocab, vocab, generator=g), -1) * 0.8 + 0.05  # rows >= 0.05
    Q = torch.softmax(torch.randn(vocab, vocab, generator=g) * 2, -1)
    prompt = [2]
    joint = torch.einsum("a,ab,bc->abc", P[2], P, P)  # x1, x2, x3 of the Markov chain after token 2
    results = {}
    for label, fn in (("verify", verify), ("always", _always_accept)):
        monkeypatch.setattr(spec_mod, "verify", fn)
        counts = torch.zeros(vocab ** 3)
        gen = torch.Generator().manual_seed(1)
        target, drafter = MarkovTarget(P.log()), MarkovDrafter(Q)
        for _ in range(n):
            res = speculative_decode(target, drafter, prompt, 2, 3, temperature=1.0, generator=gen)
            a, b, c = res.tokens
            counts[a * 16 + b * 4 + c] += 1
        results[label] = _chi2(counts, joint.flatten(), n)
    stat, df = results["verify"]
    assert stat < _chi2_critical(df), results
    stat, df = results["always"]
    assert stat > _chi2_critical(df), results


def _random_block_drafter(target, block_size=4, seed=2):
    """A DFlash drafter of ``target`` with random weights (norms too), over a random draft vocab of VD ids."""
    from types import SimpleNamespace

    from fledge.models.algorithms import DrafterSpec, build_drafter
    from tests.helpers.models import load_block_head

    cfg = SimpleNamespace(algorithm="dflash", block_size=block_size, num_draft_layers=2, draft_vocab_size=VD,
                          fc_norm=False, norm_output=False, norm_before_fc=False, parallel_drafting=False,
                          mask_token_id=3, layer="auto")
    spec = DrafterSpec.from_target_config(target.config, cfg, [2, 3, 4])
    torch.manual_seed(seed)
    d = build_drafter(spec)
    for p in d.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    load_block_head(d, target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    return d.eval()


def test_block_drafter_greedy_is_identical_and_drafts_k_per_round(target):
    from fledge.evaluation.speculative import BlockProposer, proposer_for

    drafter = _random_block_drafter(target)
    prop = proposer_for(drafter)
    assert isinstance(prop, BlockProposer)
    runner, plain = TargetRunner(target, drafter.spec.aux_layer_ids), TargetRunner(target)
    for prompt in PROMPTS:
        ref, _ = greedy_decode(plain, prompt, 30)
        res = speculative_decode(runner, prop, prompt, 3, 30)
        assert res.tokens == ref
        assert all(r.drafted == 3 for r in res.rounds if not r.budget_limited)
        # the context cache holds exactly the verified positions: prompt + every emitted token but the pending one
        assert prop.n == len(prompt) + len(res.tokens) - 1 and prop.kv[0][0].shape[2] == prop.n


def test_block_proposer_drafts_what_one_fresh_block_drafts(target):
    """After rounds of appends, the cached context gives the drafts of a block over a fresh context of the same
    verified positions (no rejected draft leaks into the cache)."""
    from fledge.evaluation.speculative import BlockProposer

    drafter = _random_block_drafter(target)
    prop, runner = BlockProposer(drafter), TargetRunner(target, drafter.spec.aux_layer_ids)
    prompt = PROMPTS[1]
    res = speculative_decode(runner, prop, prompt, 3, 12)
    drafts, _ = prop.propose(None, 3)
    seq = list(prompt) + res.tokens
    full = TargetRunner(target, drafter.spec.aux_layer_ids)
    _, aux = full.prefill(seq[:-1])
    with torch.no_grad():
        kv = drafter.context_kv(drafter.context(aux[None]), torch.arange(len(seq) - 1)[None])
        logits = drafter.draft(torch.tensor([seq[-1]]), torch.tensor([len(seq) - 1]), kv, 3)[0]  # [3, VD]
        fresh = drafter.draft_to_target(logits.argmax(-1)).tolist()  # draft ids -> the target ids proposed
    assert drafts == fresh


def test_block_drafter_sampling_is_lossless_in_distribution(target):
    """Sampled block drafts with rejection sampling: the first emitted token's distribution is the target's (a
    chi-square test, as for the chain drafter)."""
    from fledge.evaluation.speculative import BlockProposer

    drafter = _random_block_drafter(target)
    prompt = PROMPTS[0]
    plain = TargetRunner(target)
    logits, _ = plain.prefill(prompt + [7])
    p = torch.softmax(logits[-1] / 1.0, -1)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    n = 400
    runner, prop = TargetRunner(target, drafter.spec.aux_layer_ids), BlockProposer(drafter)
    for _ in range(n):
        runner.reset()
        prop.reset()
        _, aux = runner.prefill(prompt)
        prop.observe(list(prompt[1:]) + [7], aux)
        drafts, q = prop.propose(None, 3, 1.0, g)
        out, _ = runner.forward([7] + drafts)
        k, nxt = verify(drafts, q, out, 1.0, g)
        counts[drafts[0] if k >= 1 else nxt] += 1
    stat, df = _chi2(counts, p, n)
    assert stat < _chi2_critical(df)
