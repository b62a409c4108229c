"""The tiny targets' builder (testbed/tiny_target.py, testbed/tiny_writer.py): tokenizer + chat template, the
data sets, and the trained Llama of recipe=tiny, which must write (not loop) and answer each prompt its own way."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from fledge.testbed import hints, tiny_tasks, tiny_writer
from tests.helpers.paths import REPO

CONV = [
    {"role": "system", "content": "Answer precisely and briefly."},
    {"role": "user", "content": "Sort by age: Ada 31, Bob 20."},
    {"role": "assistant", "content": "Bob 20, Ada 31"},
    {"role": "user", "content": "Now shout it."},
    {"role": "assistant", "content": "BOB 20, ADA 31"},
]


def _masked_spans(ids, mask):
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_chat_template_and_assistant_mask(random_tiny_target):
    tok = AutoTokenizer.from_pretrained(random_tiny_target)
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>" and len(tok) <= tiny_writer.MODEL["vocab_size"]
    text = tok.apply_chat_template(CONV, tokenize=False)
    for m in CONV:
        assert f"<|{m['role']}|>{m['content']}<|end|>" in text
    assert text.startswith("<|bos|>")
    prompt = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>Sort by age: Ada 31, Bob 20.<|end|>\n<|assistant|>")

    enc = tok.apply_chat_template(CONV, return_dict=True, return_assistant_tokens_mask=True)
    spans = _masked_spans(enc["input_ids"], enc["assistant_masks"])
    want = [tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
            for m in CONV if m["role"] == "assistant"]
    assert spans == want  # exactly assistant content + end-of-turn, nothing of the scaffolding
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_random_target_matches_recipe_shape(random_tiny_target):
    model = AutoModelForCausalLM.from_pretrained(random_tiny_target)
    c = model.config
    want = OmegaConf.load(REPO / "conf/target/tiny.yaml")
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == \
        (want.num_hidden_layers, want.hidden_size, want.vocab_size)
    L = c.num_hidden_layers
    assert len({2, L // 2, L - 3}) == 3
    assert c.num_key_value_heads < c.num_attention_heads and c.max_position_embeddings >= 1024
    assert not c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    for family in ("moe", "mla"):  # one tokenizer for every tiny target
        assert OmegaConf.load(REPO / f"conf/target/tiny_{family}.yaml").vocab_size == c.vocab_size


def test_data_is_deterministic_and_the_sets_differ_as_named(tiny_data, tmp_path):
    fresh = tiny_writer.build_data(tmp_path)
    for name in ("train", *tiny_writer.SETS):
        assert (fresh / f"{name}.jsonl").read_bytes() == (tiny_data / f"{name}.jsonl").read_bytes()
    rows = {n: [json.loads(line) for line in (tiny_data / f"{n}.jsonl").read_text().splitlines()]
            for n in ("train", *tiny_writer.SETS)}
    assert len(rows["train"]) == tiny_writer.N_TRAIN and len(rows["eval"]) == tiny_writer.N_EVAL
    layout = {n: {r.get("template_kwargs", {}).get("layout", "chat") for r in convs} for n, convs in rows.items()}
    assert layout["train"] == layout["eval"] == {tiny_tasks.DEFAULT_LAYOUT}  # the drafter's layout only
    assert tiny_tasks.DEFAULT_LAYOUT not in layout["eval_perturbed"] and len(layout["eval_perturbed"]) >= 2
    assert all(r["messages"][0]["role"] == "system" for r in rows["eval_perturbed"])
    seen = {json.dumps(r["messages"][:-1]) for r in rows["train"]}
    assert not any(json.dumps(r["messages"][:-1]) in seen for r in rows["eval"])  # held out


def test_tokenizer_is_deterministic(random_tiny_target, tmp_path):
    fresh = tiny_writer.build_tokenizer(tmp_path)
    assert (fresh / "tokenizer.json").read_text() == (Path(random_tiny_target) / "tokenizer.json").read_text()


def test_target_writes_and_answers_each_prompt(tiny_target, tiny_data):
    """The main job's target must write (recipes/tiny/README.md): greedy output non-degenerate (distinct-3 >= 0.5)
    on >= 90% of every set's prompts, and two prompts give two continuations."""
    m = json.loads((tiny_target / "metrics.json").read_text())
    assert m["steps"] == tiny_writer.FAMILY_BUDGETS["llama"]["steps"] and m["parameters"] > 1e6
    assert m["heldout_loss"] < math.log(tiny_writer.MODEL["vocab_size"]) - 4 and m["heldout_top1"] > 0.5
    for name in tiny_writer.SETS:
        assert m[name]["non_degenerate"] >= 0.9 and m[name]["distinct3"] >= 0.5, (name, m[name])
        assert m[name]["distinct_outputs"] >= 0.75 and m[name]["pairs_sharing"] < 0.1, (name, m[name])

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    assert model.dtype == torch.bfloat16
    outs = []
    for ids, _ in tiny_writer.prompts(tok, tiny_data, "eval", n=2):
        gen = model.float().generate(torch.tensor([ids]), max_new_tokens=96, do_sample=False)[0, len(ids):].tolist()
        assert tok.eos_token_id in gen  # it ends its answer
        outs.append(tok.decode(gen, skip_special_tokens=True))
    assert outs[0] != outs[1] and all(o.strip() for o in outs)


def test_rebuild_is_cached(tiny_target):
    from fledge.testbed import targets

    t0 = time.time()
    assert targets.build("llama") == tiny_target
    assert time.time() - t0 < 10
    with pytest.raises(ValueError, match="tiny target 'quick'"):
        targets.build("quick")


@pytest.mark.parametrize("path,cmd", [
    (".cache/tiny_target/llama", "`fledge tiny-target`"),
    (".cache/tiny_target/data/eval.jsonl", "`fledge tiny-target`"),
    (".cache/tiny_target/moe", "`fledge tiny-target moe`"), (".cache/tiny_target/mla", "`fledge tiny-target mla`"),
    (".cache/tiny_target/long", "`fledge tiny-target long`"),
    (".cache/tiny_target/long_eval/long_eval.jsonl", "`fledge tiny-target long`"), ("/data/mine", "")])
def test_build_hint_names_the_command(path, cmd):
    assert hints.build_hint(path) == (f"build it with {cmd}" if cmd else "")
