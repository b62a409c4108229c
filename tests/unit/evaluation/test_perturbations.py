"""The template perturbations (evaluation/perturbations.py): each changes one thing of a held-out conversation's
layout and leaves its turns' words, and as eval sets they pair with ``default`` prompt for prompt."""

import pytest

from fledge.data.prepare.chat import ChatRenderer
from fledge.evaluation.perturbations import LONG_SYSTEM, OTHER_SYSTEM, PERTURBATIONS, perturbed
from fledge.evaluation.prompt_sets import build_prompt_sets
from fledge.run_layout import RunLayout
from tests.helpers.evaluation import eval_cfg, tokenizer


def _conv(i, system=None):
    msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"},
            {"role": "user", "content": f"follow-up {i}"}]
    return {"messages": ([{"role": "system", "content": system}] if system is not None else []) + msgs, "index": i}


def test_each_perturbation_changes_one_thing_of_the_layout():
    convs = [_conv(0, system="own"), _conv(1), _conv(2)]
    none, other, long_ = (perturbed(n, convs, 1)[0]["messages"] for n in ("system_none", "system_other", "system_long"))
    assert none[0] == {"role": "system", "content": ""} and other[0]["content"] == OTHER_SYSTEM
    assert long_[0]["content"] == LONG_SYSTEM and len(LONG_SYSTEM.split()) > 250
    for msgs in (none, other, long_):  # the conversation's own system prompt replaced, its turns untouched
        assert msgs[1:] == convs[0]["messages"][1:]
    fmt = perturbed("user_format", convs, 1)[0]["messages"]
    assert [m["role"] for m in fmt] == [m["role"] for m in convs[0]["messages"]]
    assert "### Request\nquestion 0\n" in fmt[1]["content"] and fmt[2]["content"] == "answer 0"
    hist = perturbed("history", convs, 1)[0]["messages"]
    # an unrelated exchange from a conversation outside the set (the next one), after the system prompt
    assert [m["content"] for m in hist] == ["own", "question 1", "answer 1", "question 0", "answer 0", "follow-up 0"]


def test_history_borrows_from_inside_the_set_only_when_the_split_has_nothing_else():
    convs = [_conv(0), _conv(1)]
    assert [m["content"] for m in perturbed("history", convs, 2)[1]["messages"][:2]] == ["question 0", "answer 0"]
    assert perturbed("history", convs[:1], 1)[0] == convs[0]  # nothing to borrow: left as it is


def test_perturbed_sets_pair_with_default_prompt_for_prompt(run):
    """As eval sets: the same conversations as ``default``, each rendered differently, none cut short."""
    cfg = eval_cfg(run)
    cfg.eval.sets = ["default", *PERTURBATIONS]
    renderer = ChatRenderer(tokenizer())
    sets = build_prompt_sets(cfg.eval, renderer, RunLayout(run / "run").prepare, 10_000)
    assert set(sets) == {"default", *PERTURBATIONS}
    n = len(sets["default"])
    assert n > 0
    for name in PERTURBATIONS:
        assert len(sets[name]) == n, name
        assert all(p != d for p, d in zip(sets[name], sets["default"])), name
    # the default set's own conversation text is inside every perturbed prompt of the same row
    tail = renderer.tok.decode(sets["default"][0][-8:])
    assert all(tail in renderer.tok.decode(sets[name][0]) for name in PERTURBATIONS if name != "user_format")


@pytest.mark.parametrize("name", sorted(PERTURBATIONS))
def test_perturbation_names_are_eval_set_names(name):
    from fledge.evaluation.eval_sets import check_set_names

    check_set_names([name])
