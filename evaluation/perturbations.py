"""Template perturbations a real user meets, as eval sets paired with ``default``.

EAGLE-3.1's robustness claim (the Attention Drift paper's strongest effect) is about what the chat template
wraps around a conversation: a drafter trained under one layout is served under others. Each set here takes
the same first ``eval.num_prompts`` held-out conversations as the ``default`` set and changes one thing of
their layout, the turns' own words untouched, so each set's AL over ``default``'s is that perturbation's effect
on one drafter, and the ratio of the two drafters' is the paper's comparison:

* ``system_none``: an explicit empty system prompt (ChatML templates write their own default when none is
  given, which is how ShareGPT conversations are rendered for training);
* ``system_other``: another short system prompt;
* ``system_long``: a long operator system prompt (about 350 tokens of instructions, as products deploy);
* ``user_format``: each user turn wrapped in an application's request template (headings, a guidelines list);
* ``history``: an unrelated earlier exchange (another held-out conversation's first user turn and answer) put
  before the conversation, as a chat that goes on across topics.

The prepare stage's own ``perturbed`` set (data/prepare/perturb.py) draws one system-prompt mode per
conversation for training-time perturbation; these sets measure one perturbation each. The report's
distinct-3-gram ratio per set shows whether the target stays fluent under it (a perturbation the target loops
under measures the loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

OTHER_SYSTEM = "You are a concise assistant. Answer precisely and do not repeat the question."

LONG_SYSTEM = (
    "You are the assistant of a customer-facing help desk run by a software company. Follow these rules in every "
    "answer.\n\n"
    "1. Identity. You are an AI assistant. Do not claim to be a person, do not invent a name for yourself and do "
    "not claim access to systems you were not given.\n"
    "2. Accuracy. Answer only what you can support. When a question depends on facts you do not have (an account, "
    "an order number, a date), say which fact you need and ask for it instead of guessing.\n"
    "3. Structure. Start with a one-sentence answer, then give the details. Use short paragraphs. Use numbered "
    "steps for procedures and bullet points for lists of options. Put code, commands and file names in code "
    "formatting.\n"
    "4. Tone. Be polite, plain and direct. Avoid filler such as 'Great question'. Do not apologise more than once.\n"
    "5. Safety. Do not help with anything illegal or harmful. Do not give medical, legal or financial advice "
    "beyond general information, and suggest a qualified professional where it matters.\n"
    "6. Privacy. Never ask for passwords, full card numbers or other secrets. If a user shares one, tell them to "
    "change it and do not repeat it.\n"
    "7. Scope. You may answer general questions outside the product as well, with the same care.\n"
    "8. Length. Keep answers under 300 words unless the user asks for more detail or for a complete document.\n"
    "9. Language. Answer in the language of the user's last message.\n"
    "10. Escalation. When a user is upset or the problem needs a human, say that a support agent can take over "
    "and how to reach one, and still answer what you can.\n\n"
    "Today's date is 4 December 2026. The product's current version is 5.2, released in October 2026."
)

USER_FORMAT = ("### Request\n{content}\n\n### Guidelines\n- Answer the request above.\n- Be accurate and complete."
               "\n- Use markdown where it helps.")

_Perturb = Callable[[dict, Sequence[dict]], dict]


def _messages(conv: dict) -> list[dict]:
    """The turns without a leading system message (each perturbation sets its own)."""
    msgs = [dict(m) for m in conv["messages"]]
    return msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs


def _system(text: str) -> _Perturb:
    return lambda conv, others: {**conv, "messages": [{"role": "system", "content": text}] + _messages(conv)}


def _user_format(conv: dict, others: Sequence[dict]) -> dict:
    msgs = [dict(m, content=USER_FORMAT.format(content=m["content"])) if m["role"] == "user" else m
            for m in conv["messages"]]
    return {**conv, "messages": msgs}


def _history(conv: dict, others: Sequence[dict]) -> dict:
    """``conv`` after the first exchange of the first of ``others`` that has one."""
    for o in others:
        turns = _messages(o)
        if len(turns) >= 2 and turns[0]["role"] == "user" and turns[1]["role"] == "assistant":
            head = [m for m in conv["messages"][:1] if m["role"] == "system"]
            return {**conv, "messages": head + turns[:2] + _messages(conv)}
    return conv


PERTURBATIONS: dict[str, _Perturb] = {
    "system_none": _system(""),
    "system_other": _system(OTHER_SYSTEM),
    "system_long": _system(LONG_SYSTEM),
    "user_format": _user_format,
    "history": _history,
}


def perturbed(name: str, convs: Sequence[dict], n: int) -> list[dict]:
    """The first ``n`` of ``convs`` under perturbation ``name``; the conversations a ``history`` borrows from are
    the ones after each (the whole held-out split, so never one of the same set when it has more than ``n``)."""
    fn = PERTURBATIONS[name]
    return [fn(c, list(convs[max(i + 1, n):]) + list(convs[i + 1:n]) + list(convs[:i])) for i, c in
            enumerate(convs[:n])]
