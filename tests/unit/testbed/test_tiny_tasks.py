"""The writing target's chat language (testbed/tiny_tasks.py): seeded, prompt-dependent, mostly computed
answers, and a chat template whose layouts differ in what surrounds the turns while the assistant mask still
marks exactly the answer."""

import random

from fledge.testbed import tiny_tasks


def test_seeded_and_prompt_dependent():
    a = [tiny_tasks.conversation(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]
    convs = [tiny_tasks.conversation(random.Random(s), "chat") for s in range(200)]
    users = {c["messages"][-2]["content"]: c["messages"][-1]["content"] for c in convs}
    assert len(set(users.values())) > 150  # different prompts, different answers


def test_answers_mostly_computed():
    """Prompt lookup would copy: most answer words must not appear in the prompt."""
    new = total = 0
    for s in range(300):
        msgs = tiny_tasks.conversation(random.Random(s), "chat")["messages"]
        prompt = set(" ".join(m["content"] for m in msgs[:-1]).replace(",", " ").split())
        words = msgs[-1]["content"].replace(",", " ").split()
        new += sum(w not in prompt for w in words)
        total += len(words)
    assert new / total > 0.4


def test_layouts_change_the_scaffolding_only(tmp_path):
    """Each layout renders the same turns in other scaffolding; under every one the assistant mask marks
    exactly the answers (what a drafter learns and the target's loss is measured on)."""
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_writer

    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer(tmp_path))
    conv = tiny_tasks.conversation(random.Random(5), system=True)
    answers = "".join(m["content"] + "<|end|>" for m in conv["messages"] if m["role"] == "assistant")
    texts = set()
    for lay in tiny_tasks.LAYOUTS:
        enc = tok.apply_chat_template(conv["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                      layout=lay)
        texts.add(tok.decode(enc["input_ids"]))
        marked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
        assert tok.decode(marked) == answers, lay
    assert len(texts) == len(tiny_tasks.LAYOUTS)
    default = tok.apply_chat_template(conv["messages"], tokenize=False)
    assert default == tok.apply_chat_template(conv["messages"], tokenize=False, layout=tiny_tasks.DEFAULT_LAYOUT)
