"""AL vs context length (evaluation/long_context.py): the same conversations cut to each bucket, the request kept,
the cut within a line of the bucket; the long tiny split and whole-file documents (testbed/tiny_long.py)."""


import pytest

from fledge.evaluation.long_context import bucket_prompts, cut_to


def _encode(conv, upto):  # one token per word, plus 2 for the template around each message
    return [w for m in conv["messages"][:upto] for w in ["<m>"] + m["content"].split() + ["</m>"]]


def _conv(n_lines, words=5, tag="x"):
    ctx = "\n".join(" ".join(f"{tag}{i}_{j}" for j in range(words)) for i in range(n_lines))
    return {"messages": [{"role": "user", "content": "Continue this file:\n" + ctx},
                         {"role": "assistant", "content": "the answer"}]}


def test_cut_keeps_the_request_and_the_end_of_the_context():
    conv = _conv(40)
    full = _encode(conv, 1)
    assert len(full) == 3 + 200 + 2 - 1 + 1  # request (3 words), 200 context words, 2 template tokens
    for bucket in (20, 64, 100, 150):
        ids = cut_to(conv, 1, _encode, bucket)
        assert bucket - 5 < len(ids) <= bucket  # within one line (5 words) of the bucket
        assert ids[:4] == ["<m>", "Continue", "this", "file:"]  # the request stays
        assert ids[-2:] == ["x39_4", "</m>"]  # the context nearest the answer stays
    assert cut_to(conv, 1, _encode, 1000) == full
    assert cut_to(conv, 1, _encode, 4) is None  # not even the request fits


def test_buckets_hold_the_same_conversations():
    convs = [_conv(3, tag="short")] + [_conv(30 + i, tag=f"c{i}-") for i in range(4)]
    out = bucket_prompts(convs, lambda c: 1, _encode, [16, 64, 128], n=3)
    assert [len(v) for v in out.values()] == [3, 3, 3]
    for b, prompts in out.items():
        assert all(b - 5 < len(p) <= b for p in prompts)
    # the short conversation never reaches 128 tokens and is left out of every bucket; the next three are in
    # every bucket, in order, each ending with its own last context line
    for prompts in out.values():
        assert [p[-2] for p in prompts] == ["c0-29_4", "c1-30_4", "c2-31_4"]
    assert all(not any(w.startswith("short") for w in p) for ps in out.values() for p in ps)


def test_long_eval_split_and_whole_files():
    from fledge.testbed import tiny_corpus, tiny_long

    train, held = tiny_corpus.split_sources(tiny_corpus.list_sources())
    rows = tiny_long.long_eval_conversations(held, seed=7)
    assert len(rows) >= 16 and len({r["source"] for r in rows}) >= 6
    by_path = {f.path: f for f in held}
    for r in rows:
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        f = by_path[r["source"]]
        assert len(user) >= tiny_long.LONG_EVAL_MIN_CONTEXT_CHARS
        assert user.endswith(f.lines[r["cut_line"] - 1]) and answer.startswith(f.lines[r["cut_line"]].strip("\n"))
    stream = tiny_long.mixed_stream(train[:60], seed=0, long_share=0.5)
    convs = [next(stream) for _ in range(200)]
    asks = ("Show me the source", "Print ", "Paste the whole")
    whole = [c for c in convs if c["messages"][0]["content"].startswith(asks)
             and len(c["messages"]) == 2 and len(c["messages"][1]["content"]) > tiny_long.LONG_DOC_CHARS // 2]
    assert 70 <= len(whole) <= 130  # about half, and those are long


def test_context_buckets_are_validated():
    from fledge.conf.schema import Config

    cfg = Config()
    cfg.target.num_hidden_layers = 8
    cfg.eval.context_buckets = [512, 256]
    with pytest.raises(ValueError, match="eval.context_buckets"):
        cfg.validate()
    cfg.eval.context_buckets = [256, 512]
    cfg.validate()


def test_position_loss_buckets_every_predicted_token(random_tiny_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fledge.testbed import tiny_long

    tok = AutoTokenizer.from_pretrained(random_tiny_target)
    model = AutoModelForCausalLM.from_pretrained(random_tiny_target, dtype=torch.float32).eval()
    convs = [_conv(40), _conv(60, tag="y")]
    out = tiny_long.position_loss(model, tok, convs, [0, 16, 32, 64], max_tokens=64)
    assert out["tokens"] == [2 * 15, 2 * 16, 2 * 32]  # positions 1..63 of two 64-token rows
    assert all(v is not None and 0 < v < 20 for v in out["loss"])


def test_long_training_data_is_the_long_stream_and_cached(tmp_path, monkeypatch):
    """`fledge tiny-target --budget long` also writes the drafters' long conversations (data=tiny_long): about
    half whole files, the same rows on a rebuild, and a finished build is reused, not rewritten."""
    import json

    from fledge.testbed import tiny_long, tiny_target

    monkeypatch.setattr(tiny_target, "N_LONG_TRAIN", 60)
    out = tiny_target.build_long_data(tmp_path)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    long_rows = [r for r in rows if len(r["messages"][-1]["content"]) > tiny_long.LONG_DOC_CHARS // 2]
    assert 15 <= len(long_rows) <= 45  # long_share 0.5 of whole files (each >= 7,000 characters)
    meta = json.loads((out / "build.json").read_text())
    assert meta["rows"] == 60 and meta["rows_over_6000_chars"] == len(long_rows)
    mtime = (out / "train.jsonl").stat().st_mtime_ns
    assert tiny_target.build_long_data(tmp_path) == out and (out / "train.jsonl").stat().st_mtime_ns == mtime
    monkeypatch.setattr(tiny_target, "N_LONG_TRAIN", 61)  # another setting is another key: rebuilt
    tiny_target.build_long_data(tmp_path)
    again = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert again[:60] == rows and len(again) == 61


def test_long_recipe_fits_the_long_target():
    """recipe=tiny_long reads the long data and target; its rows fit a micro-batch and its largest context bucket
    plus the generation fits the long target's positions (the builder's MODEL_FOR)."""
    from fledge.conf import compose
    from fledge.testbed import tiny_target

    cfg = compose(["recipe=tiny_long"])
    assert cfg.data.sources[0].path.endswith("long_data/train.jsonl") and cfg.target.name_or_path.endswith("/long")
    assert cfg.train.micro_batch_tokens >= cfg.data.max_length >= tiny_target.BUDGETS["long"]["seq_len"]
    positions = tiny_target.MODEL_FOR["long"]["max_position_embeddings"]
    assert cfg.eval.context_buckets[-1] + cfg.eval.max_new_tokens <= positions
    assert cfg.eval.context_buckets[-1] > tiny_target.BUDGETS["long"]["seq_len"]  # past the training length


def test_missing_tiny_target_names_its_build_command():
    """Before any stage runs, a testbed target or data file that is not built yet names its build command
    (testbed/hints.py); the libraries below say only that the path is missing."""
    from fledge.conf import compose
    from fledge.train.pipeline import check_sources
    from fledge.train.preflight import check_target_path

    for path, cmd in ((".cache/tiny_target/long", "--budget long`"), (".cache/tiny_target/quick", "--budget quick`"),
                      (".cache/tiny_target/moe-quick", "--budget quick --family moe`")):
        with pytest.raises(ValueError, match="target.name_or_path") as e:
            check_target_path(f"/nonexistent/{path}")
        assert f"fledge tiny-target {cmd}" in str(e.value)
    cfg = compose(["recipe=tiny_long", "data.sources.0.path=/nonexistent/.cache/tiny_target/long_data/train.jsonl"])
    with pytest.raises(ValueError, match="fledge tiny-target --budget long`"):  # recipe=tiny_long's data
        check_sources(cfg)
    from fledge.data.prepare.sources import iter_rows

    with pytest.raises(ValueError, match="no such file or directory") as e:
        next(iter_rows("/nonexistent/.cache/tiny_target/long_data/train.jsonl"))
    assert "tiny-target" not in str(e.value)
