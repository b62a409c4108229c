"""Speculative decoding harness: chain drafting, greedy / rejection-sampling verification, prompt lookup.

One round, with the target's KV cache holding everything but the pending token ``x`` (the last token
emitted, not yet read by the target)::

    drafts d_1..d_k  <- proposer (drafter chain, or n-gram copy from the context)
    target reads [x, d_1..d_k] in one forward -> k+1 next-token distributions and aux states
    accept d_1..d_n, emit a bonus token from the target's distribution after d_n (AL = n + 1)
    roll the target's cache back to the accepted length; the bonus token becomes the new pending token

The drafter's cache holds only rows fed with *real* target features: row t pairs the aux states after
x_t with the token x_{t+1} (the step-0 alignment of docs/architecture.md, Training-time test). Draft rows are transient
and cropped before the accepted rows of the next round are appended, exactly as serving engines do.

Greedy (temperature 0) output equals plain greedy decoding of the target token for token; sampling uses
standard rejection sampling (accept d with min(1, p(d)/q(d)), else resample from norm(max(0, p - q))),
which leaves the target's distribution unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fledge.models.algorithms import algorithm_of
from fledge.models.drafter import DraftCache


@dataclass
class Round:
    drafted: int  # draft tokens proposed (k, fewer near the token budget or on a lookup miss)
    accepted: int  # of those, accepted by the target
    emitted: int  # tokens this round added to the output (accepted + bonus, cut at an end-of-turn token)
    budget_limited: bool  # k was cut by max_new_tokens: left out of the AL statistics


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids after the prompt (an end-of-turn token included when emitted)
    rounds: list[Round] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards (prefill included)

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s


PREFILL_CHUNK = 4096  # prompt tokens per prefill forward


class TargetRunner:
    """A transformers causal LM with a DynamicCache: ``forward(ids)`` appends ``ids`` and returns fp32
    logits ``[S, V]`` and the aux states ``[S, n*Ht]`` (``hidden_states[k]``, k in ``aux_layer_ids``:
    the boundary convention) or None when no aux ids are set; ``crop(n)`` keeps the first n positions.
    ``prefill(prompt)`` is ``forward`` for a prompt of any length: pieces of ``prefill_chunk`` tokens and
    only the last row's logits, so a 128K prompt never holds [S, V] logits or [S, S] attention scores."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int] | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.model = model.eval()
        self.prefill_chunk = prefill_chunk
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else None
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)[None]
        want_aux = self.aux_layer_ids is not None
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, output_hidden_states=want_aux,
                         **({"logits_to_keep": 1} if last_only else {}))
        aux = torch.cat([out.hidden_states[k][0] for k in self.aux_layer_ids], -1) if want_aux else None
        return out.logits[0].float(), aux

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a prompt in pieces of ``prefill_chunk`` tokens: (the last row's logits [1, V], aux [S, n*Ht])."""
        ids = list(ids)
        auxes, logits = [], None
        for s in range(0, len(ids), self.prefill_chunk):
            logits, aux = self.forward(ids[s:s + self.prefill_chunk], last_only=True)
            auxes.append(aux)
        return logits[-1:], (torch.cat(auxes) if self.aux_layer_ids is not None else None)

    def crop(self, length: int) -> None:
        remove = len(self) - length
        if remove > 0:  # transformers 5 crops by a negative count of tokens to remove
            self.cache.crop(-remove)


class Proposer(Protocol):
    needs_aux: bool

    def reset(self) -> None: ...

    def observe(self, next_tokens: Sequence[int], aux: torch.Tensor | None) -> None: ...

    def propose(self, history: Sequence[int], k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]: ...


class Probe(Protocol):
    """What ``DrafterProposer`` tells a probe after every draft step (evaluation/drift.py ``DriftProbe``)."""

    def record(self, depth: int, position: int, fed: torch.Tensor, cache: DraftCache, n_context: int) -> None: ...


class DrafterProposer:
    """Chain drafting with an ``Eagle3Drafter`` (engine path: ``fuse`` + ``decode_step`` + ``DraftCache``).

    ``propose`` returns target-vocab ids and, when sampling, q ``[k, V]`` (the drafter's tempered
    distribution scattered onto the target vocab through ``d2t``). ``probe`` (evaluation/drift.py) is called
    after every draft step with (depth, position, fed-in state, cache, committed rows)."""

    needs_aux = True

    def __init__(self, drafter: nn.Module, probe: Probe | None = None):
        self.drafter = drafter.eval()
        self.probe = probe
        self.device = drafter.lm_head.weight.device
        self.dtype = drafter.lm_head.weight.dtype
        self.targets = drafter.draft_to_target(torch.arange(drafter.spec.draft_vocab_size, device=self.device))
        self.reset()

    def reset(self) -> None:

        self.cache, self.n = DraftCache(), 0
        self.last_logits = self.last_state = None

    @torch.inference_mode()
    def observe(self, next_tokens: Sequence[int], aux: torch.Tensor | None) -> None:
        """Commit rows n..n+S-1: aux states after x_t paired with x_{t+1} (``next_tokens``)."""
        assert aux is not None and aux.shape[0] == len(next_tokens)
        self.cache.crop(self.n)  # drop last round's draft rows
        S = len(next_tokens)
        ids = torch.as_tensor(list(next_tokens), device=self.device)[None]
        pos = torch.arange(self.n, self.n + S, device=self.device)[None]
        g = self.drafter.fuse(aux.to(self.device, self.dtype)[None])
        logits, state = self.drafter.decode_step(ids, g, pos, self.cache)
        self.n += S
        self.last_logits, self.last_state = logits[0, -1].float(), state[:, -1:]
        if self.probe is not None:
            self.probe.record(0, self.n - 1, g[:, -1:], self.cache, self.n)

    @torch.inference_mode()
    def propose(self, history: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        self.cache.crop(self.n)  # a second propose without observe re-drafts from the committed rows
        drafts, qs = [], []
        logits, state = self.last_logits, self.last_state
        for depth in range(k):
            if depth:  # feed back the last state with the draft just made, at position n - 1 + depth
                fed = state
                ids = torch.tensor([[drafts[-1]]], device=self.device)
                if self.drafter.spec.parallel_drafting:  # P-EAGLE: the mask slot, independent of the drafts
                    ids, fed = self.drafter.parallel_inputs(ids)
                pos = torch.tensor([[self.n - 1 + depth]], device=self.device)
                out, state = self.drafter.decode_step(ids, fed, pos, self.cache)
                logits = out[0, -1].float()
                if self.probe is not None:
                    self.probe.record(depth, self.n - 1 + depth, fed, self.cache, self.n)
            if temperature > 0:
                qd = torch.softmax(logits / temperature, -1)
                i = int(torch.multinomial(qd.cpu(), 1, generator=generator))
                q = torch.zeros(self.drafter.spec.vocab_size)
                q[self.targets.cpu()] = qd.cpu()
                qs.append(q)
            else:
                i = int(logits.argmax())
            drafts.append(int(self.targets[i]))
        return drafts, (torch.stack(qs) if qs else None)


class BlockProposer:
    """Block drafting with a ``DFlashDrafter`` (models/dflash.py; DSpark's too, models/dspark.py), as vLLM's DFlash
    and DSpark proposers run it: the context keys and values of every verified position, kept per layer and appended
    to as rows are committed (they never hold a draft), and one forward over [bonus token, masks] per round, whose
    slots the drafter's ``propose`` picks (DSpark's in order, each biased by the token picked before it). ``propose``
    returns target ids and, when sampling, q ``[k, V]``: each slot sampled from its own tempered distribution over the
    draft vocab, scattered onto the target vocab through ``d2t``."""

    needs_aux = True

    def __init__(self, drafter: nn.Module):
        self.drafter = drafter.eval()
        self.device = drafter.lm_head.weight.device
        self.dtype = drafter.lm_head.weight.dtype
        self.targets = drafter.draft_to_target(torch.arange(drafter.spec.draft_vocab_size, device=self.device))
        self.reset()

    def reset(self) -> None:
        self.kv, self.n, self.bonus = None, 0, None

    @torch.inference_mode()
    def observe(self, next_tokens: Sequence[int], aux: torch.Tensor | None) -> None:
        """Commit positions n..n+S-1 (aux states after x_t); the last of ``next_tokens`` is the bonus token x_{n+S}."""
        assert aux is not None and aux.shape[0] == len(next_tokens)
        S = len(next_tokens)
        ctx = self.drafter.context(aux.to(self.device, self.dtype)[None])
        kv = self.drafter.context_kv(ctx, torch.arange(self.n, self.n + S, device=self.device)[None])
        self.kv = kv if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                              for (k0, v0), (k1, v1) in zip(self.kv, kv)]
        self.n += S
        self.bonus = int(next_tokens[-1])

    @torch.inference_mode()
    def propose(self, history: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        bonus, position = torch.tensor([self.bonus], device=self.device), torch.tensor([self.n], device=self.device)
        if temperature <= 0:
            ids, _ = self.drafter.propose(bonus, position, self.kv, k)
            return [int(i) for i in ids[0]], None

        def sample(logits: torch.Tensor) -> torch.Tensor:  # each row from its tempered distribution, in order
            q = torch.softmax(logits.float() / temperature, -1).cpu()
            rows = [torch.multinomial(row, 1, generator=generator) for row in q.reshape(-1, q.shape[-1])]
            return torch.cat(rows).view(q.shape[:-1]).to(logits.device)

        ids, logits = self.drafter.propose(bonus, position, self.kv, k, sample)
        q = torch.zeros(k, self.drafter.spec.vocab_size)  # each slot's draft-vocab distribution on the target vocab
        q[:, self.targets.cpu()] = torch.softmax(logits[0].float() / temperature, -1).cpu()
        return [int(i) for i in ids[0]], q


def proposer_for(drafter: nn.Module, probe: Probe | None = None) -> Proposer:
    """The in-process proposer of a drafter's algorithm (models/algorithms.py): chain drafting for EAGLE (P-EAGLE
    included, whose slots ``DrafterProposer`` feeds), one block per round for a block drafter (DFlash)."""
    if algorithm_of(drafter.spec).block:
        if probe is not None:
            raise ValueError("the drift probe follows a chain drafter's fed-back state; a block drafter has none")
        return BlockProposer(drafter)
    return DrafterProposer(drafter, probe=probe)


class LookupProposer:
    """Prompt lookup (n-gram copy): find the earliest occurrence of the context's last n tokens (the longest n
    from max_ngram down to min_ngram, never the tail itself) and propose up to k tokens that followed it;
    nothing on a miss. vLLM's ``ngram`` method picks the same match (vllm/v1/spec_decode/ngram_proposer.py),
    so the in-process baseline is the one the engine serves: on a loop the earliest match has k tokens after
    it where the latest, right behind the tail, has one."""

    needs_aux = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def observe(self, next_tokens: Sequence[int], aux: torch.Tensor | None) -> None:
        pass

    def propose(self, history: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        h = list(history)
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            for start in range(len(h) - n):  # earliest match first, never the tail itself
                if h[start:start + n] == tail:
                    return h[start + n:start + n + k], None
        return [], None


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=generator))


def verify(drafts: Sequence[int], q: torch.Tensor | None, logits: torch.Tensor, temperature: float = 0.0,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Accept a prefix of ``drafts`` against the target's ``logits [len(drafts)+1, V]`` (row i: the
    distribution of the token after d_i's predecessor); returns (accepted count n, next token).

    Greedy: accept while d_i is the target's argmax; the next token is the argmax after d_n. Sampling:
    accept d_i with probability min(1, p(d_i)/q(d_i)); on rejection resample from norm(max(0, p - q));
    after all k, sample the bonus from p. ``q`` None means deterministic drafts (q = one-hot)."""
    if temperature <= 0:
        for i, d in enumerate(drafts):
            if int(logits[i].argmax()) != d:
                return i, int(logits[i].argmax())
        return len(drafts), int(logits[len(drafts)].argmax())
    p = torch.softmax(logits.cpu() / temperature, -1)
    for i, d in enumerate(drafts):
        qi = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).float()
        r = float(torch.rand((), generator=generator))
        if r * float(qi[d]) < float(p[i, d]):  # r < p/q without dividing by a tiny q
            continue
        residual = (p[i] - qi).clamp_min(0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def speculative_decode(target: TargetRunner, proposer: Proposer, prompt: Sequence[int], k: int,
                       max_new_tokens: int, eos_ids: Sequence[int] = (), temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> DecodeResult:
    """Generate up to ``max_new_tokens`` after ``prompt`` with k-token chain drafts (see module doc)."""
    if k < 1 or max_new_tokens < 1:
        raise ValueError(f"eval.draft_tokens={k} and eval.max_new_tokens={max_new_tokens} must be >= 1")
    eos = set(eos_ids)
    target.reset()
    proposer.reset()
    res = DecodeResult(tokens=[])
    t0 = time.perf_counter()
    logits, aux = target.prefill(prompt)
    x = _pick(logits[-1], temperature, generator)
    res.verify_s += time.perf_counter() - t0
    res.tokens.append(x)
    t0 = time.perf_counter()
    if proposer.needs_aux:
        proposer.observe(list(prompt[1:]) + [x], aux)  # row t: aux after x_t, token x_{t+1}
    res.draft_s += time.perf_counter() - t0
    while len(res.tokens) < max_new_tokens and res.tokens[-1] not in eos:
        kk = min(k, max_new_tokens - len(res.tokens) - 1)  # a round emits at most kk + 1 tokens
        committed = len(target)
        t0 = time.perf_counter()
        drafts, q = proposer.propose(list(prompt) + res.tokens, kk, temperature, generator) if kk else ([], None)
        drafts = drafts[:kk]
        t1 = time.perf_counter()
        logits, aux = target.forward([res.tokens[-1]] + drafts)
        n, nxt = verify(drafts, None if q is None else q[:len(drafts)], logits, temperature, generator)
        target.crop(committed + 1 + n)
        t2 = time.perf_counter()
        new = drafts[:n] + [nxt]
        if proposer.needs_aux:
            proposer.observe(new, aux[:n + 1])
        t3 = time.perf_counter()
        res.draft_s += (t1 - t0) + (t3 - t2)
        res.verify_s += t2 - t1
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        res.tokens += new[:cut]
        res.rounds.append(Round(len(drafts), n, cut, budget_limited=kk < k))
    return res


@torch.inference_mode()
def greedy_decode(target: TargetRunner, prompt: Sequence[int], max_new_tokens: int,
                  eos_ids: Sequence[int] = ()) -> tuple[list[int], float]:
    """Plain greedy decoding with the KV cache, one token per forward: (tokens, seconds)."""
    eos = set(eos_ids)
    target.reset()
    t0 = time.perf_counter()
    logits, _ = target.prefill(prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits, _ = target.forward(out[-1:])
        out.append(int(logits[-1].argmax()))
    return out, time.perf_counter() - t0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length mismatch counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
