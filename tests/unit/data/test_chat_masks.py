"""Loss masks checked token by token against hand-written segmentations of five template families."""

import json

import pytest

from fledge.data.prepare.chat import ChatRenderer
from fledge.data.prepare.sources import DataError, normalize
from tests.helpers.chat_templates import CHATML, LLAMA3, MARKERS, MISTRAL, QWEN3, make_tokenizer

G = True  # a segment the target generates


def expected_mask(tok, segments):
    """(text, mask) from [(text, generated)]; asserts no token straddles a segment boundary."""
    text = "".join(s for s, _ in segments)
    gen = []
    for s, g in segments:
        gen += [g] * len(s)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for s, e in enc["offset_mapping"]:
        assert len(set(gen[s:e])) == 1, f"token {text[s:e]!r} straddles a segment boundary"
        mask.append(int(gen[s]))
    return text, enc["input_ids"], mask


def check(template, conv, segments, bos="<|bos|>", eos="<|eos|>", **kw):
    tok = make_tokenizer(template, bos=bos, eos=eos)
    r = ChatRenderer(tok, **kw)
    text, ids_ref, mask_ref = expected_mask(tok, segments)
    assert r.render(conv)[0] == text  # the hand segmentation is the template's rendering
    ids, mask = r.encode(conv, "test[0]")
    assert ids == ids_ref
    assert mask == mask_ref, _diff(tok, ids, mask, mask_ref)
    return tok, ids, mask


def _diff(tok, ids, got, want):
    return "\n".join(f"{tok.decode([i])!r}: got {g} want {w}" for i, g, w in zip(ids, got, want) if g != w)


def conv(*turns, **extra):
    return normalize({"messages": [dict(t) for t in turns], **extra}, "test[0]")


SYS, U1, A1, U2, A2 = "You are terse.", "Hello there", "I am fine, thank you.", "The weather?", "Sunny in Paris."


def test_llama3_prefix_diff_finds_eot_by_probe():
    c = conv({"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1},
             {"role": "user", "content": U2}, {"role": "assistant", "content": A2})
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    segs = [("<|bos|>", 0), (h("system") + "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                              + SYS + "<|eot_id|>", 0),
            (h("user") + U1 + "<|eot_id|>", 0), (h("assistant"), 0), (A1 + "<|eot_id|>", G),
            (h("user") + U2 + "<|eot_id|>", 0), (h("assistant"), 0), (A2 + "<|eot_id|>", G)]
    tok, ids, mask = check(LLAMA3, c, segs)  # eos is <|eos|>: <|eot_id|> must come from the probe
    r = ChatRenderer(tok)
    assert not r.has_markers and tok.convert_tokens_to_ids("<|eot_id|>") in r.eot_ids
    # A date perturbation reaches the template and stays out of the mask.
    c2 = {**c, "template_kwargs": {"date_string": "01 Jan 2025"}}
    ids2, mask2 = r.encode(c2, "x")
    assert "01 Jan 2025" in tok.decode(ids2) and sum(mask2) == sum(mask)


def test_llama3_last_turn_only():
    c = conv({"role": "user", "content": U1}, {"role": "assistant", "content": A1},
             {"role": "user", "content": U2}, {"role": "assistant", "content": A2})
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    segs = [("<|bos|>", 0), (h("system") + "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                              "<|eot_id|>", 0),
            (h("user") + U1 + "<|eot_id|>" + h("assistant") + A1 + "<|eot_id|>", 0),
            (h("user") + U2 + "<|eot_id|>" + h("assistant"), 0), (A2 + "<|eot_id|>", G)]
    check(LLAMA3, c, segs, last_turn_only=True)


@pytest.mark.parametrize("thinking_in_mask", [True, False])
def test_qwen3_thinking(thinking_in_mask):
    # Turn 1's thinking is inline <think> (moved to reasoning_content); the template drops it from history.
    c = conv({"role": "system", "content": SYS}, {"role": "user", "content": U1},
             {"role": "assistant", "content": "<think>\nold thought\n</think>\n\n" + A1},
             {"role": "user", "content": U2},
             {"role": "assistant", "content": A2, "reasoning_content": "think about weather"})
    assert c["messages"][2] == {"role": "assistant", "content": A1, "reasoning_content": "old thought"}
    think = "<think>\nthink about weather\n</think>"
    segs = [(f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n", 0),
            (A1 + "<|im_end|>", G), (f"\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n", 0),
            (think + "\n\n", thinking_in_mask), (A2 + "<|im_end|>", G), ("\n", 0)]
    tok, ids, mask = check(QWEN3, c, segs, eos="<|im_end|>", thinking_in_mask=thinking_in_mask)
    assert "old thought" not in tok.decode(ids)


def test_qwen3_tool_call_and_empty_think():
    c = conv({"role": "user", "content": U2},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps({"city": "Paris"})}}]},
             {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": A2})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    segs = [(f"<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n", 0), (call + "<|im_end|>", G),
            ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\n\n</think>\n\n" + A2 + "<|im_end|>", G), ("\n", 0)]
    check(QWEN3, c, segs, eos="<|im_end|>")


def test_chatml_eos_elsewhere():
    c = conv({"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1})
    segs = [(f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n", 0),
            (A1 + "<|im_end|>", G), ("\n", 0)]
    check(CHATML, c, segs)  # tokenizer eos is <|eos|>: the probe finds <|im_end|>


def test_mistral_style():
    c = conv({"role": "user", "content": U1}, {"role": "assistant", "content": A1},
             {"role": "user", "content": U2}, {"role": "assistant", "content": A2})
    segs = [("<s>", 0), (f"[INST] {U1} [/INST]", 0), (f" {A1}</s>", G), (f"[INST] {U2} [/INST]", 0), (f" {A2}</s>", G)]
    check(MISTRAL, c, segs, bos="<s>", eos="</s>")


def test_generation_markers():
    c = conv({"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1},
             {"role": "user", "content": U2}, {"role": "assistant", "content": A2})
    segs = [("<|bos|>", 0), (f"<|system|>\n{SYS}<|end|>\n<|user|>\n{U1}<|end|>\n<|assistant|>\n", 0),
            (A1 + "<|end|>", G), (f"<|user|>\n{U2}<|end|>\n<|assistant|>\n", 0), (A2 + "<|end|>", G)]
    # (jinja's trim_blocks eats the newline after {% endgeneration %})
    tok, _, _ = check(MARKERS, c, segs)
    assert ChatRenderer(tok).has_markers


def test_template_render_failure_names_conversation():
    tok = make_tokenizer(MISTRAL, bos="<s>", eos="</s>")
    c = conv({"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1})
    with pytest.raises(DataError, match=r"data.jsonl:7: the chat template failed.*Only user and assistant"):
        ChatRenderer(tok).encode(c, "data.jsonl:7")


def test_prefix_unstable_template_raises():
    unstable = CHATML.replace("{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n\\n' }}")
    tok = make_tokenizer(unstable)
    c = conv({"role": "user", "content": U1}, {"role": "assistant", "content": A1})
    with pytest.raises(DataError, match=r"rows\[3\]: chat template is not prefix-stable.*message 1"):
        ChatRenderer(tok).encode(c, "rows[3]")


def test_prefix_unstable_tokenization_raises():
    # The generation prompt ends mid-word: "Hel" + "lo" tokenizes as "Hello" in the full rendering.
    t = CHATML.replace("'\\n' + message['content']", "' Hel' + message['content']").replace(
        "assistant\\n' }}", "assistant Hel' }}")
    tok = make_tokenizer(t)
    c = conv({"role": "user", "content": U1}, {"role": "assistant", "content": "lo there"})
    with pytest.raises(DataError, match=r"f.jsonl:2: tokenization is not prefix-stable at assistant message 1"):
        ChatRenderer(tok).encode(c, "f.jsonl:2")


@pytest.mark.parametrize("thinking_in_mask", [True, False])
def test_thinking_inline_for_templates_without_a_reasoning_field(thinking_in_mask):
    c = conv({"role": "user", "content": U1}, {"role": "assistant", "content": A1, "reasoning_content": "why"})
    segs = [(f"<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\nwhy\n</think>\n\n", thinking_in_mask), (A1 + "<|im_end|>", G), ("\n", 0)]
    check(CHATML, c, segs, thinking_in_mask=thinking_in_mask)
