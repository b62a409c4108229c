"""AL vs context length (evaluation/long_context.py): the same conversations cut to each bucket, the request kept,
the cut within a line of the bucket; the long tiny target's tasks, stream, data and eval prompts
(testbed/tiny_long.py)."""


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


def test_context_buckets_are_validated():
    from fledge.conf.schema import Config

    cfg = Config()
    cfg.target.num_hidden_layers = 8
    cfg.eval.context_buckets = [512, 256]
    with pytest.raises(ValueError, match="eval.context_buckets"):
        cfg.validate()
    cfg.eval.context_buckets = [256, 512]
    cfg.validate()


@pytest.fixture(scope="module")
def writer_tok():
    from transformers import AutoTokenizer

    from fledge.testbed import tiny_long, tiny_writer

    tok = AutoTokenizer.from_pretrained(tiny_writer.build_tokenizer())  # cached in .cache (seconds the first time)
    tok.model_max_length = tiny_long.MODEL["max_position_embeddings"]
    return tok


def _user(conv):
    return next(m["content"] for m in conv["messages"] if m["role"] == "user")


def test_long_tasks_answer_from_their_lines():
    """The long tasks' answers are computed from the context lines: a directory lookup of one unique name (among
    the last ``tail`` lines when asked), a ledger total of the last lines."""
    import random
    import re

    from fledge.testbed import tiny_tasks

    rng = random.Random(3)
    for _ in range(20):
        user, ans = tiny_tasks.long_directory(rng, 300, tail=8)
        head, *rows = user.split("\n")
        who = re.search(r"Find (\S+) and", head).group(1)
        hits = [i for i, r in enumerate(rows) if r.split(" | ")[0] == who]
        assert len(hits) == 1 and hits[0] >= 300 - 8
        _, city, job, age = rows[hits[0]].split(" | ")
        assert ans.startswith(f"{who} is a {age}-year-old {job} from {city}.")
        user, ans = tiny_tasks.long_ledger(rng, 300)
        head, *rows = user.split("\n")
        last = int(re.search(r"the last (\d+)", head).group(1))
        sales = [re.fullmatch(r"(\w+) bought (\d+) (\w+) at (\d+)", r).groups() for r in rows[-last:]]
        assert ans.endswith(f"Total of the last {last}: {sum(int(q) * int(p) for _, q, _, p in sales)}.")


def test_long_eval_prompts_reach_the_top_bucket_and_keep_their_answer(writer_tok):
    """Every long-eval prompt reaches the top bucket (past the training windows), and cut to any bucket it keeps
    its request and every line its answer is computed from; tiny_long.cut is evaluation/long_context.py's cut."""
    import re

    from fledge.testbed import tiny_long

    encode = tiny_long.encoder(writer_tok)
    convs = tiny_long.long_eval_conversations(seed=41, n=tiny_long.N_LONG_EVAL)
    assert {_user(c).split(" ")[0] for c in convs} == {"Directory", "Ledger"}
    for conv in convs:
        assert len(encode(conv, 1)) >= tiny_long.BUCKETS[-1] > tiny_long.BUDGET["seq_len"]
        head, *rows = _user(conv).split("\n")
        if head.startswith("Directory"):
            who = re.search(r"Find (\S+) and", head).group(1)
            needed = [r for r in rows if r.startswith(who + " |")]
        else:
            needed = rows[-int(re.search(r"the last (\d+)", head).group(1)):]
        for b in tiny_long.BUCKETS:
            ids = cut_to(conv, 1, encode, b)
            assert b - 24 < len(ids) <= b and ids == tiny_long.cut(conv, encode, b)
            text = writer_tok.decode(ids)
            assert head in text and all(r in text for r in needed), (b, head)


def test_long_stream_fits_the_training_windows(writer_tok):
    """The long target's stream: about LONG_SHARE long tasks, each (any layout, system turn included) inside one
    2,048-token window, every layout drawn; seeded."""
    from fledge.testbed import tiny_long, tiny_tasks

    s = tiny_long.stream(0)
    convs = [next(s) for _ in range(300)]
    longs = [c for c in convs if tiny_long.is_long(c)]
    assert 0.5 * tiny_long.LONG_SHARE * 300 <= len(longs) <= 1.5 * tiny_long.LONG_SHARE * 300
    lengths = [len(writer_tok(writer_tok.apply_chat_template(c["messages"], tokenize=False, **c["template_kwargs"]),
                              add_special_tokens=False)["input_ids"]) for c in longs]
    assert max(lengths) <= tiny_long.BUDGET["seq_len"] and max(lengths) > tiny_long.BUDGET["seq_len"] // 2
    assert {c["template_kwargs"]["layout"] for c in convs} == set(tiny_tasks.LAYOUTS)
    assert [next(tiny_long.stream(0)) for _ in range(1)] == convs[:1]


def test_long_data_is_the_stream_in_the_default_layout_and_cached(tmp_path, monkeypatch):
    """build_long_data writes the stream's conversations in the default layout (train and a held-out eval), the
    same rows on a rebuild; a finished build is reused, another setting rebuilt."""
    import json

    from fledge.testbed import tiny_long, tiny_tasks

    monkeypatch.setattr(tiny_long, "N_TRAIN", 60)
    monkeypatch.setattr(tiny_long, "N_EVAL", 10)
    out = tiny_long.build_long_data(tmp_path)
    rows = {n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()] for n in ("train", "eval")}
    assert len(rows["train"]) == 60 and len(rows["eval"]) == 10
    assert all(r["template_kwargs"]["layout"] == tiny_tasks.DEFAULT_LAYOUT for rs in rows.values() for r in rs)
    assert not {json.dumps(r) for r in rows["eval"]} & {json.dumps(r) for r in rows["train"]}
    assert json.loads((out / "build.json").read_text())["long_train"] == sum(map(tiny_long.is_long, rows["train"])) > 0
    mtime = (out / "train.jsonl").stat().st_mtime_ns
    assert tiny_long.build_long_data(tmp_path) == out and (out / "train.jsonl").stat().st_mtime_ns == mtime
    monkeypatch.setattr(tiny_long, "N_TRAIN", 61)
    tiny_long.build_long_data(tmp_path)
    again = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert again[:60] == rows["train"] and len(again) == 61


def test_long_recipe_fits_the_long_target():
    """recipe=tiny_long reads the long data and target; its rows fit a micro-batch, its largest context bucket plus
    the generation fits the target's positions and lies past the training windows, the long set inside them."""
    from fledge.conf import compose
    from fledge.testbed import tiny_long, tiny_tasks

    cfg = compose(["recipe=tiny_long"])
    assert cfg.data.sources[0].path.endswith("long_data/train.jsonl") and cfg.target.name_or_path.endswith("/long")
    assert cfg.data.eval_sources[0].path.endswith("long_data/eval.jsonl")
    assert cfg.eval.long_context_source.endswith("long_eval/long_eval.jsonl")
    seq = tiny_long.BUDGET["seq_len"]
    assert cfg.train.micro_batch_tokens >= cfg.data.max_length >= seq
    assert cfg.eval.context_buckets[-1] + cfg.eval.max_new_tokens <= tiny_long.MODEL["max_position_embeddings"]
    assert cfg.eval.context_buckets[-1] > seq >= cfg.eval.long_prompt_tokens + cfg.eval.max_new_tokens
    assert list(cfg.eval.context_buckets) == list(tiny_long.BUCKETS)
    assert (cfg.target.hidden_size, cfg.target.vocab_size) == (tiny_long.MODEL["hidden_size"],
                                                                 tiny_long.MODEL["vocab_size"])
    assert cfg.drafter.draft_vocab_size <= tiny_long.MODEL["vocab_size"]
    layouts = set(cfg.data.perturb.template_vars["layout"])
    assert layouts and layouts <= set(tiny_tasks.LAYOUTS) - {tiny_tasks.DEFAULT_LAYOUT}


def test_missing_tiny_target_names_its_build_command():
    """Before any stage runs, a testbed target or data file that is not built yet names its build command
    (testbed/hints.py); the libraries below say only that the path is missing."""
    from fledge.conf import compose
    from fledge.pipeline.preflight import check_target_path
    from fledge.pipeline.stages import check_sources, prepare_inputs

    for path, cmd in ((".cache/tiny_target/long", "long`"), (".cache/tiny_target/llama", "`"),
                      (".cache/tiny_target/moe", "moe`")):
        with pytest.raises(ValueError, match="target.name_or_path") as e:
            check_target_path(f"/nonexistent/{path}")
        assert f"fledge tiny-target{' ' if cmd != '`' else ''}{cmd}" in str(e.value)
    cfg = compose(["recipe=tiny_long", "data.sources.0.path=/nonexistent/.cache/tiny_target/long_data/train.jsonl"])
    with pytest.raises(ValueError, match="fledge tiny-target long`"):  # recipe=tiny_long's data
        check_sources(prepare_inputs(cfg))
    from fledge.data.prepare.sources import iter_rows

    with pytest.raises(ValueError, match="no such file or directory") as e:
        next(iter_rows("/nonexistent/.cache/tiny_target/long_data/train.jsonl"))
    assert "tiny-target" not in str(e.value)
