"""The prepare stage end to end on a local tokenizer: outputs, counts, policies, determinism, vocab reuse."""

import json

import pytest

from fledge.conf.schema import Config, DataConfig, PerturbConfig, SourceConfig
from fledge.data.prepare.build import prepare
from fledge.data.prepare.vocab import DraftVocab
from fledge.run_layout import PrepareDir
from tests.helpers.chat_templates import QWEN3, make_tokenizer

WORDS = "hello there the quick brown fox jumps over lazy dog weather Paris sunny answer question".split()


def _conv(i):
    w = lambda k: " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(k))  # noqa: E731
    msgs = [{"role": "user", "content": w(3 + i % 4)}, {"role": "assistant", "content": w(4 + i % 9)}]
    if i % 3 == 0:
        msgs += [{"role": "user", "content": w(2)}, {"role": "assistant", "content": w(5), "reasoning_content": w(3)}]
    if i % 2:
        return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                  for m in msgs]}
    return {"messages": msgs}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    make_tokenizer(QWEN3, eos="<|im_end|>").save_pretrained(d)
    return d


def _write(path, rows, bad=()):
    lines = [json.dumps(r) for r in rows]
    for at, text in bad:
        lines.insert(at, text)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _cfg(target, src, out, **data):
    cfg = Config()
    cfg.target.name_or_path, cfg.target.num_hidden_layers, cfg.target.vocab_size = str(target), 8, 420
    cfg.drafter.draft_vocab_size = 64
    cfg.data = DataConfig(sources=[SourceConfig(path=src)], eval_fraction=0.1, **{"max_length": 60, **data})
    cfg.recipe = "test"
    return cfg


def _run(cfg, out):
    out.mkdir(parents=True, exist_ok=True)
    return prepare(cfg.data, cfg.target, cfg.drafter.draft_vocab_size, cfg.run.seed, PrepareDir(out))


def test_prepare_outputs(target, tmp_path):
    import datasets

    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(40)])
    cfg = _cfg(target, src, tmp_path, length_policy="truncate",
               perturb=PerturbConfig(fraction=0.5, system_prompts=["Be kind."]))
    s = _run(cfg, tmp_path / "p")
    stage = tmp_path / "p"
    assert s["kept"] + s["dropped"] == 36 and s["skipped"] == 0 and s["truncated"] > 0
    assert s["mask_method"] == "prefix_diff" and 0 < s["draft_vocab_coverage"] <= 1
    tr = datasets.load_from_disk(str(stage / "train"))
    assert tr.features["input_ids"].feature.dtype == "int32" and tr.features["loss_mask"].feature.dtype == "int8"
    assert {"input_ids", "loss_mask", "source", "index"} <= set(tr.column_names)
    assert max(len(x) for x in tr["input_ids"]) <= 60 and sum(map(len, tr["input_ids"])) == s["tokens"]
    assert sum(sum(m) for m in tr["loss_mask"]) == s["masked_tokens"]
    ev = datasets.load_from_disk(str(stage / "eval"))
    lines = [json.loads(x) for x in (stage / "eval_conversations.jsonl").read_text().splitlines()]
    assert len(lines) == len(ev) == 4 and [x["index"] for x in lines] == ev["index"]
    assert not set(ev["index"]) & set(tr["index"])  # held out before mixing
    pert = [json.loads(x) for x in (stage / "eval_perturbed_conversations.jsonl").read_text().splitlines()]
    assert len(pert) == 4 and all("date_string" in p["template_kwargs"] for p in pert)
    assert len(datasets.load_from_disk(str(stage / "eval_perturbed"))) == 4
    v = DraftVocab.load(stage / "vocab.safetensors")
    meta = json.loads((stage / "vocab.json").read_text())
    assert v.size == 64 and len(v.t2d) == 420 and meta["coverage"] == pytest.approx(v.coverage(), abs=1e-6)
    assert int(v.counts.sum()) == s["masked_tokens"] and not meta["reused"]
    assert not list(stage.glob(".*"))  # no build leftovers
    # A second run over the same directory reuses the vocab (same key) and writes the same data.
    s2 = _run(cfg, stage)
    assert json.loads((stage / "vocab.json").read_text())["reused"] and s2["tokens"] == s["tokens"]


def test_prepare_deterministic_across_processes(target, tmp_path):
    """data.num_proc sets only how many processes tokenize: every file prepare writes is the same on 1 and 2 (so
    pipeline/stages.py reads it as a runtime key, and changing it keeps a run's prepare output)."""
    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(24)])
    outs = []
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        _run(_cfg(target, src, tmp_path, num_proc=n, perturb=PerturbConfig(fraction=0.5)), out)
        outs.append({str(p.relative_to(out)): p.read_bytes().replace(str(out).encode(), b"<out>")
                     for p in sorted(out.rglob("*")) if p.is_file()})
    assert {"train/data-00000-of-00001.arrow", "eval_perturbed/state.json", "eval_perturbed_conversations.jsonl",
            "vocab.safetensors", "summary.json"} <= set(outs[0])
    assert outs[0] == outs[1]


def test_bad_input_policies(target, tmp_path):
    rows = [_conv(i) for i in range(12)]
    bad = [(2, "{not json"), (5, json.dumps({"messages": [{"role": "user", "content": "q"}]})),
           (7, json.dumps({"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}))]
    src = _write(tmp_path / "bad.jsonl", rows, bad)
    stage = tmp_path / "p"
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON.*on_error=skip"):
        _run(_cfg(target, src, tmp_path), stage)
    assert not any(stage.iterdir())  # nothing written
    s = _run(_cfg(target, src, tmp_path, on_error="skip"), stage)
    assert s["skipped"] == 3 and len(s["errors_first"]) == 3
    assert "bad.jsonl:6: no assistant turn" in s["errors_first"][1] and "unknown role 'robot'" in s["errors_first"][2]
    # A template that fails at render time is caught per conversation too (system role under Mistral-ish).
    sys_rows = [{"messages": [{"role": "system", "content": "s"}] + _conv(0)["messages"]}] + rows
    src2 = _write(tmp_path / "sys.jsonl", sys_rows)
    cfg = _cfg(target, src2, tmp_path, on_error="skip",
               chat_template="{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                             "{% endif %}{{ m.content }}<|im_end|>{% endfor %}")
    s = _run(cfg, tmp_path / "q")
    assert s["skipped"] == 1 and "sys.jsonl:1: the chat template failed" in s["errors_first"][0]


def test_drop_policy_and_last_turn_only(target, tmp_path):
    import datasets

    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(30)])
    a = _run(_cfg(target, src, tmp_path, length_policy="drop", max_length=40), tmp_path / "a")
    b = _run(_cfg(target, src, tmp_path, length_policy="truncate", max_length=40), tmp_path / "b")
    assert a["dropped"] >= b["truncated"] > 0 and a["truncated"] == 0
    c = _run(_cfg(target, src, tmp_path, last_turn_only=True, max_length=400), tmp_path / "c")
    d = _run(_cfg(target, src, tmp_path, max_length=400), tmp_path / "d")
    assert c["tokens"] == d["tokens"] and c["masked_tokens"] < d["masked_tokens"]
    ds = datasets.load_from_disk(str(tmp_path / "c" / "train"))
    for m in ds["loss_mask"]:  # one contiguous masked run per conversation
        starts = sum(1 for j, x in enumerate(m) if x and (j == 0 or not m[j - 1]))
        assert starts == 1
