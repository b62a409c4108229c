"""The tiny real target: tokenizer + chat template, data split, and the trained quick target."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from fledge.testbed import tiny_corpus
from tests.helpers.paths import REPO

CONV = [
    {"role": "system", "content": "You answer with Python source code only."},
    {"role": "user", "content": "Show me the definition of `dedent`."},
    {"role": "assistant", "content": "def dedent(text):\n    return text"},
    {"role": "user", "content": "go on"},
    {"role": "assistant", "content": "\n\ndef indent(text, prefix):\n    pass"},
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
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>" and len(tok) == 4096
    text = tok.apply_chat_template(CONV, tokenize=False)
    for m in CONV:
        assert f"<|{m['role']}|>{m['content']}<|end|>" in text
    assert text.startswith("<|bos|>")
    prompt = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>Show me the definition of `dedent`.<|end|>\n<|assistant|>")

    enc = tok.apply_chat_template(CONV, return_dict=True, return_assistant_tokens_mask=True)
    spans = _masked_spans(enc["input_ids"], enc["assistant_masks"])
    want = [tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
            for m in CONV if m["role"] == "assistant"]
    assert spans == want  # exactly assistant content + end-of-turn, nothing of the scaffolding
    assert sum(enc["assistant_masks"]) == sum(map(len, want))
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_random_target_matches_recipe_shape(random_tiny_target):
    model = AutoModelForCausalLM.from_pretrained(random_tiny_target)
    c = model.config
    want = OmegaConf.load(REPO / "conf/target/tiny.yaml")
    assert OmegaConf.load(REPO / "conf/target/tiny_testbed.yaml").num_hidden_layers == want.num_hidden_layers
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == \
        (want.num_hidden_layers, want.hidden_size, want.vocab_size)
    L = c.num_hidden_layers
    assert len({2, L // 2, L - 3}) == 3
    assert c.num_key_value_heads < c.num_attention_heads and c.max_position_embeddings >= 1024
    assert not c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_data_is_deterministic_and_split_by_module(tiny_target_script, tiny_data, tmp_path):
    fresh = tiny_target_script.build_data(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (fresh / name).read_bytes() == (tiny_data / name).read_bytes()
    meta = json.loads((tiny_data / "build.json").read_text())
    assert meta["eval_modules"] and not set(meta["eval_modules"]) & set(meta["train_modules"])

    files = {f.path: "\n".join(f.lines) for f in tiny_corpus.list_sources()}
    held = "\0".join(files[p] for p in meta["eval_modules"])
    seen = "\0".join(files[p] for p in meta["train_modules"])
    evals = [json.loads(line) for line in (tiny_data / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == meta["n_eval"]
    for conv in evals[:40]:
        user, answer = (m["content"] for m in conv["messages"])
        snippet = user.split("\n", 1)[1].strip("\n")
        assert snippet in held and answer in held and answer not in seen
        # Cut from the middle of a file: the snippet is not the file's opening.
        assert not any(text.startswith(snippet) for text in files.values())
    trains = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()]
    assert len(trains) == meta["n_train"]
    roles = {m["role"] for c in trains for m in c["messages"]}
    assert roles == {"system", "user", "assistant"}
    assert any(len(c["messages"]) >= 4 for c in trains)
    for conv in trains[:40]:
        assert conv["messages"][-1]["content"] in seen


def test_tokenizer_is_deterministic(tiny_target_script, random_tiny_target, tmp_path):
    fresh = tiny_target_script.build_tokenizer(tmp_path)
    assert (fresh / "tokenizer.json").read_text() == (Path(random_tiny_target) / "tokenizer.json").read_text()


def test_quick_target_learned_something(tiny_target_script, tiny_target, tiny_data):
    metrics = json.loads((tiny_target / "metrics.json").read_text())
    # The quick budget (~2 min) only has to be clearly past uniform (ln 4096 = 8.3) and chance top-1.
    assert metrics["heldout_loss"] < math.log(4096) - 1.5
    assert metrics["heldout_top1"] > 100 / 4096
    assert metrics["steps"] == tiny_target_script.BUDGETS["quick"]["steps"] and metrics["parameters"] > 1e6
    assert 0 < metrics["distinct3"] <= 1

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    assert model.dtype == torch.bfloat16
    conv = json.loads((tiny_data / "eval.jsonl").read_text().splitlines()[0])
    enc = tok.apply_chat_template(conv["messages"][:1], add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1]:]
    assert out[0].item() != tok.eos_token_id and tok.decode(out, skip_special_tokens=True).strip()


def test_rebuild_is_cached(tiny_target_script, tiny_target):
    t0 = time.time()
    assert tiny_target_script.build_tiny_target("quick") == tiny_target
    assert time.time() - t0 < 10
    with pytest.raises(ValueError, match="budget"):
        tiny_target_script.build_tiny_target("huge")
