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
