"""A synthetic chat language a few-million-parameter target learns in minutes and that does not loop.

Each user turn states a task on a small random "document" (records, an order, a table, a phrase); the
assistant's answer is a deterministic function of it, so greedy output depends on the prompt, ends, and is
mostly *computed* (sorted, summed, reworded, upper-cased), not copied, which keeps prompt lookup honest.
Conversations are rendered under several chat layouts (``LAYOUTS``: role markers and turn layout, chosen by
the ``layout`` template variable) and system prompts, so the target stays fluent under all of them, while a
drafter's data uses the default layout only: the perturbed eval set (another layout, another system prompt)
changes what the drafter conditions on and not what the target writes.

``conversation(rng)`` draws one; ``long_conversation(rng, rows)`` a table question over many rows (the
long-context set); ``with_context`` prefixes a question with other tasks' answers, as the main job's long set
is built (evaluation/prompt_sets.py ``lengthen``). ``mixed(rng)`` draws all three kinds, the target's stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NAMES = ["Ada", "Bob", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena", "Milo",
         "Nora", "Otto", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Xena", "Yuri", "Zoe"]
CITIES = ["Oslo", "Lima", "Rome", "Kyiv", "Cairo", "Paris", "Tokyo", "Quito", "Delhi", "Perth", "Riga",
          "Bern", "Accra", "Hanoi", "Dakar", "Porto"]
JOBS = ["baker", "pilot", "nurse", "coder", "judge", "tailor", "farmer", "singer", "doctor", "painter",
        "sailor", "writer", "miner", "chef"]
ITEMS = ["apple", "pear", "lamp", "chair", "book", "cup", "shirt", "candle", "brush", "kettle", "rope",
         "plate", "clock", "glove", "map", "drum"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "grey", "pink"]
WORDS = ["quick", "fox", "river", "stone", "light", "music", "paper", "garden", "window", "silver", "cloud",
         "forest", "bridge", "winter", "candle", "ocean", "letter", "mirror", "shadow", "engine"]

SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer precisely and briefly.",
                  "You are a careful clerk who checks every number.", "Follow the user's format exactly."]
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, END = "<|pad|>", "<|bos|>", "<|end|>"
DEFAULT_LAYOUT = "chat"
# Assistant content and its end-of-turn token sit inside {% generation %}, so that
# apply_chat_template(return_assistant_tokens_mask=True) marks exactly the tokens a drafter learns.
# Role markers and layout per template variable ``layout``; the special tokens stay (the mask needs them).
LAYOUTS = ("chat", "hash", "inst")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set lay = layout | default('chat') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% if lay == 'hash' %}### Assistant:\n{% elif lay == 'inst' %}[ANSWER]\n{% else %}<|assistant|>{% endif %}"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{% if lay == 'hash' %}### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n\n"
    "{% elif lay == 'inst' %}"
    "[{{ message['role'] | upper }}] {{ message['content'] }} [/{{ message['role'] | upper }}]\n"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n{% endif %}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if lay == 'hash' %}### Assistant:\n{% elif lay == 'inst' %}[ANSWER]\n{% else %}<|assistant|>{% endif %}"
    "{% endif %}"
)


def _people(rng: random.Random, n: int) -> list[dict]:
    return [dict(name=name, city=rng.choice(CITIES), job=rng.choice(JOBS), age=rng.randint(18, 80))
            for name in rng.sample(NAMES, n)]


def _profile(rng):
    p = _people(rng, 1)[0]
    style = rng.choice(["short profile", "formal bio", "one-line summary"])
    facts = "; ".join(f"{k}={p[k]}" for k in rng.sample(["name", "city", "job", "age"], 4))
    user = f"Facts: {facts}. Write a {style}."
    if style == "short profile":
        ans = (f"{p['name']} is a {p['age']}-year-old {p['job']} from {p['city']}. "
               f"In ten years {p['name']} will be {p['age'] + 10}.")
    elif style == "formal bio":
        ans = (f"Name: {p['name'].upper()}\nOccupation: {p['job'].capitalize()}\nResidence: {p['city']}\n"
               f"Born: {2026 - p['age']}")
    else:
        ans = f"{p['job'].capitalize()}, {p['age']}, {p['city']} ({p['name'][0]}.)"
    return user, ans


def _sort(rng):
    people = _people(rng, rng.randint(3, 6))
    key, order = rng.choice(["age", "name"]), rng.choice(["ascending", "descending"])
    lines = "\n".join(f"- {p['name']} ({p['age']})" for p in people)
    user = f"Sort by {key}, {order}:\n{lines}"
    ranked = sorted(people, key=lambda p: p[key], reverse=order == "descending")
    ans = "\n".join(f"{i}. {p['name']} is {p['age']}" for i, p in enumerate(ranked, 1))
    return user, ans + f"\nOldest minus youngest: {max(p['age'] for p in people) - min(p['age'] for p in people)}."


def _order(rng):
    items = [(rng.choice(ITEMS), rng.randint(1, 9), rng.randint(2, 20)) for _ in range(rng.randint(2, 4))]
    user = "Order: " + "; ".join(f"{q} x {it} at {pr}" for it, q, pr in items) + ". What is the total?"
    lines = [f"{it}: {q} * {pr} = {q * pr}" for it, q, pr in items]
    total = sum(q * pr for _, q, pr in items)
    return user, "\n".join(lines) + f"\nTotal: {total}. With a ten percent tip: {total + total // 10}."


def _reverse(rng):
    words = rng.sample(WORDS, rng.randint(3, 7))
    return f"Reverse the order of: {' '.join(words)}", " ".join(reversed(words)) + f" ({len(words)} words)"


def _shout(rng):
    words = rng.sample(WORDS, rng.randint(3, 6))
    return f"Shout this: {' '.join(words)}", " ".join(w.upper() for w in words) + "!"


def _table(rng, n: int | None = None):
    people = _people(rng, n or rng.randint(3, 6)) if (n or 0) <= len(NAMES) else None
    people = people or [dict(name=f"{rng.choice(NAMES)}{i}", city=rng.choice(CITIES), job=rng.choice(JOBS),
                             age=rng.randint(18, 80)) for i in range(n)]
    rows = "\n".join(f"{p['name']} | {p['city']} | {p['job']} | {p['age']}" for p in people)
    who = rng.choice(people)
    user = f"Table:\nname | city | job | age\n{rows}\nWhat do we know about {who['name']}?"
    same = [p["name"] for p in people if p["city"] == who["city"] and p is not who]
    ans = (f"{who['name']} works as a {who['job']} in {who['city']} and is {who['age']}. "
           + (f"Also in {who['city']}: {', '.join(same)}." if same else f"Nobody else lives in {who['city']}."))
    return user, ans


def _count(rng):
    things = [(rng.choice(COLORS), rng.choice(ITEMS)) for _ in range(rng.randint(3, 7))]
    color = rng.choice(things)[0]
    hits = [it for c, it in things if c == color]
    user = f"How many {color} things are in: {', '.join(f'{c} {it}' for c, it in things)}?"
    return user, f"There {'is' if len(hits) == 1 else 'are'} {len(hits)}: {' and '.join(hits)}."


TASKS = (_profile, _sort, _order, _reverse, _shout, _table, _count)


def conversation(rng: random.Random, layout: str | None = None, system: bool | None = None) -> dict:
    """One conversation (one or two tasks), a system turn with probability 0.35 (or as ``system`` says), under
    ``layout`` (drawn from LAYOUTS when None) given as the ``template_kwargs`` the pipeline renders with."""
    msgs = []
    for _ in range(1 if rng.random() < 0.75 else 2):
        user, ans = rng.choice(TASKS)(rng)
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": ans}]
    if (rng.random() < 0.35) if system is None else system:
        msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return {"messages": msgs, "template_kwargs": {"layout": layout or rng.choice(LAYOUTS)}}


def long_conversation(rng: random.Random, rows: int, layout: str = DEFAULT_LAYOUT) -> dict:
    """A table question over ``rows`` rows: the answer sits anywhere in a long context."""
    user, ans = _table(rng, rows)
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ans}],
            "template_kwargs": {"layout": layout}}


def with_context(rng: random.Random, conv: dict, pieces: int) -> dict:
    """``conv`` with its first user turn prefixed by ``pieces`` answers of other tasks, laid out as
    evaluation/prompt_sets.py ``lengthen`` lays out the main job's long prompts: the answer ignores the context."""
    context = "\n\n".join(rng.choice(TASKS)(rng)[1] for _ in range(pieces))
    msgs = [dict(m) for m in conv["messages"]]
    first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    msgs[first]["content"] = f"Context:\n{context}\n\n{msgs[first]['content']}"
    return {**conv, "messages": msgs}


# The target's stream: shares of long tables (LONG_ROWS rows: their prompts fit a 512-token window) and of
# context-prefixed questions; the rest are plain conversations.
LONG_SHARE, CONTEXT_SHARE, LONG_ROWS, CONTEXT_PIECES = 0.08, 0.12, (12, 40), (2, 10)


def mixed(rng: random.Random, layout: str | None = None) -> dict:
    """One draw of the target's stream (under ``layout``, or one drawn from LAYOUTS)."""
    r = rng.random()
    if r < LONG_SHARE:
        return long_conversation(rng, rng.randint(*LONG_ROWS), layout or rng.choice(LAYOUTS))
    conv = conversation(rng, layout)
    return with_context(rng, conv, rng.randint(*CONTEXT_PIECES)) if r < LONG_SHARE + CONTEXT_SHARE else conv


def stream(seed: int) -> Iterator[dict]:
    """The target's endless training stream: every layout, with and without system prompts."""
    rng = random.Random(seed)
    while True:
        yield mixed(rng)


def tokenizer_texts(seed: int, n: int = 4000) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        for m in conversation(rng)["messages"]:
            yield m["content"]


# Long tasks (testbed/tiny_long.py): the request is the first line of the user turn and the context is one record a
# line below it, so evaluation/long_context.py can drop lines from the top and keep the request. ``tail`` picks the
# record asked about among the last ``tail`` lines (the long-context eval: the answer is the same whatever is cut
# above it); None picks any line (training: the target learns to look back over its whole window).


def _entries(rng: random.Random, n: int) -> list[dict]:
    return [dict(name=f"{rng.choice(NAMES)}{rng.randint(10, 99)}", city=rng.choice(CITIES), job=rng.choice(JOBS),
                 age=rng.randint(18, 80)) for _ in range(n)]


def long_directory(rng: random.Random, n: int, tail: int | None = None) -> tuple[str, str]:
    """A directory of ``n`` people, one a line; the request names one (among the last ``tail`` lines)."""
    people = _entries(rng, n)
    names = [p["name"] for p in people]
    pick = [i for i in range(n if tail is None else max(0, n - tail), n) if names.count(names[i]) == 1]
    who = people[rng.choice(pick)] if pick else people[-1]
    rows = "\n".join(f"{p['name']} | {p['city']} | {p['job']} | {p['age']}" for p in people)
    user = f"Directory of people. Find {who['name']} and describe them.\n{rows}"
    return user, (f"{who['name']} is a {who['age']}-year-old {who['job']} from {who['city']}. "
                  f"Born in {2026 - who['age']}.")


def long_ledger(rng: random.Random, n: int, last: int | None = None) -> tuple[str, str]:
    """A ledger of ``n`` sales, one a line; the request totals the last ``last`` (2-5) of them."""
    last = last or rng.randint(2, 5)
    sales = [(rng.choice(NAMES), rng.randint(1, 9), rng.choice(ITEMS), rng.randint(2, 20)) for _ in range(n)]
    rows = "\n".join(f"{who} bought {q} {it} at {pr}" for who, q, it, pr in sales)
    user = f"Ledger of sales. Total the last {last}.\n{rows}"
    lines = [f"{who}: {q} {it} * {pr} = {q * pr}" for who, q, it, pr in sales[-last:]]
    return user, "\n".join(lines) + f"\nTotal of the last {last}: {sum(q * pr for _, q, _, pr in sales[-last:])}."


LONG_TASKS = (long_directory, long_ledger)


def long_task(rng: random.Random, n: int, tail: int | None = None, layout: str | None = None,
              system: bool | None = None) -> dict:
    """One long conversation of ``n`` context lines (a drawn LONG_TASKS kind; ``tail`` as above), a system turn
    with probability 0.35 (or as ``system`` says), under ``layout`` (drawn from LAYOUTS when None)."""
    task = rng.choice(LONG_TASKS)
    user, ans = task(rng, n, tail) if task is long_directory else task(rng, n)
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": ans}]
    if (rng.random() < 0.35) if system is None else system:
        msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return {"messages": msgs, "template_kwargs": {"layout": layout or rng.choice(LAYOUTS)}}
