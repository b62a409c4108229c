"""The serving engine (.engine/venv, scripts/setup_engine.sh) for the tests that need it."""

from __future__ import annotations

import os

import pytest

from fledge.engine_process import engine_python


def engine_marks() -> list:
    """pytestmark of a module that needs the serving engine (.engine/venv): skipped where it is missing on a
    developer's machine; a missing engine fails collection under CI=true or FLEDGE_ENGINE=1, unless
    FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI."""
    engine = engine_python()
    missing = f"no serving engine at {engine} (bash scripts/setup_engine.sh)"
    required = os.environ.get("FLEDGE_ENGINE") == "1" or (
        os.environ.get("CI") == "true" and os.environ.get("FLEDGE_ENGINE_OPTIONAL") != "1")
    if not engine.exists() and required:
        pytest.fail(f"{missing}; CI (or FLEDGE_ENGINE=1) requires the serving engine "
                    "(FLEDGE_ENGINE_OPTIONAL=1 for an offline CI)", pytrace=False)
    return [pytest.mark.skipif(not engine.exists(), reason=missing), pytest.mark.slow]


def fake_driver_result(sets: dict[str, list[list[int]]], drafter_accepted: int = 4, lookup_accepted: int = 1,
                       sampled_accepted: int | None = None, diverge: tuple[tuple[str, int], ...] = (),
                       answer: tuple[int, ...] = (1, 2)) -> dict:
    """What serving/vllm_side/eval_driver.py returns for ``sets``, made up: every configuration drafts 4 rounds
    of k=2 per set (the drafter accepting ``drafter_accepted`` tokens, vLLM's ngram ``lookup_accepted``, the
    drafter's sampled pass ``sampled_accepted`` when given) and answers every prompt ``answer``, except that the
    drafter answers [1, 3] on each (set, prompt index) of ``diverge``, where the plain run's top-2 log-prob gap is
    1.0 (no tie: a lossless-ness failure)."""

    def counters(accepted):
        return {"drafts": 4, "draft_tokens": 8, "accepted": accepted, "accepted_per_pos": [min(accepted, 4),
                                                                                         max(0, accepted - 4)]}

    def engine_set(name, accepted, drafter=False, sampled=None):
        outs = [[1, 3] if drafter and (name, i) in diverge else list(answer) for i in range(len(sets[name]))]
        s = {"outputs": outs, "wall_s": 1.0, "tokens": 2 * len(outs), "counters": counters(accepted),
             "top2_gaps": [[1.0, 1.0] for _ in outs]}
        return {**s, "sampled": {"counters": counters(sampled), "tokens": 2, "temperature": 1.0}} if sampled else s

    return {"vllm_version": "0", "device": "CPU: test", "wall_s": 1.0, "engines": {
        "plain": {"load_s": 1, "sets": {n: engine_set(n, 0) for n in sets}},
        "drafter": {"load_s": 1, "sets": {n: engine_set(n, drafter_accepted, True, sampled_accepted) for n in sets}},
        "lookup": {"load_s": 1, "sets": {n: engine_set(n, lookup_accepted) for n in sets}}}}
