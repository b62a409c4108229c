"""Named eval sets (evaluation/eval_sets.py), offline: every registered set reads a small fixture written in its hub
dataset's own schema (tests/fixtures/eval_sets/), renders through a chat template, multi-turn sets ask later
turns after the target's own answer, prompts are bounded in number and length, and a set that cannot be
loaded is one line naming the set, the hub id and the fix. Nothing is downloaded."""

import json

import pytest
import torch

from fledge.evaluation.eval_sets import (
    EVAL_SETS,
    SPEED_BENCH_CATEGORIES,
    SPEED_BENCH_LENGTHS,
    check_set_names,
    fit_prompt,
    load_conversations,
    render_prompts,
)
from fledge.pipeline.stages import eval_inputs
from fledge.run_layout import EvalDir, RunLayout
from tests.helpers.evaluation import eval_cfg, tokenizer
from tests.helpers.paths import FIXTURES as FIXTURE_DIR

FIX = FIXTURE_DIR / "eval_sets"
FIXTURES = {"mt_bench": "mt_bench_prompts.jsonl", "gsm8k": "gsm8k_main_test.jsonl",
            "humaneval": "openai_humaneval_test.jsonl", "alpaca": "alpaca_train.jsonl",
            "cnn_dm": "cnn_dailymail_test.jsonl", "math500": "math500_test.jsonl",
            "speed_bench_qualitative": "speed_bench_qualitative_test.jsonl", "longbench_v2": "longbench_v2_data.json",
            **{f"speed_bench_{c}": "speed_bench_qualitative_test.jsonl" for c in SPEED_BENCH_CATEGORIES},
            **{f"speed_bench_throughput_{n}": "speed_bench_throughput_2k_test.jsonl" for n in SPEED_BENCH_LENGTHS}}
# What a fixture row must turn into: (set, conversation index) -> text its first user turn contains
EXPECT = {"mt_bench": "garden party", "gsm8k": "A baker makes 12 rolls", "humaneval": "def clamp(x: int",
          "alpaca": "Give three tips", "cnn_dm": "Summarize the following news article.\n\nLONDON (Fledge)",
          "math500": "sum of the roots", "speed_bench_qualitative": "reverses a list",
          "speed_bench_coding": "reverses a list", "speed_bench_math": "Solve 3x + 4 = 19.",
          "speed_bench_throughput_2k": "The river rose", "longbench_v2": "<text>\nThe keeper trimmed"}


@pytest.fixture(scope="module")
def renderer():
    from fledge.data.prepare.chat import ChatRenderer

    return ChatRenderer(tokenizer())


def test_every_registered_set_has_a_fixture_in_its_schema():
    assert set(FIXTURES) == set(EVAL_SETS)
    for name, s in EVAL_SETS.items():
        path = FIX / FIXTURES[name]
        rows = json.loads(path.read_text()) if path.suffix == ".json" else \
            [json.loads(line) for line in path.read_text().splitlines()]
        for f in s.fields:
            assert all(f in r for r in rows), (name, f)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_a_set_reads_its_fixture_and_renders_through_the_template(name, renderer):
    loaded = load_conversations(name, str(FIX / FIXTURES[name]))
    assert EXPECT[name] in loaded.conversations[0][0]
    prompts, info = render_prompts(loaded, renderer, 4096, "truncate", 64, respond=lambda ids: "fine")
    text = renderer.tok.decode(prompts[0])
    assert text.startswith("<|bos|><|user|>") and text.endswith("<|end|>\n<|assistant|>"), text[:40]
    assert EXPECT[name] in text
    assert info["source"] == str(FIX / FIXTURES[name]) and info["truncated"] == 0


def test_speed_bench_categories_and_placeholders():
    """The coding category keeps its two real rows and counts the licence placeholder row (its text is not in
    the hub copy) instead of evaluating the placeholder text; the math row is another category's."""
    coding = load_conversations("speed_bench_coding", str(FIX / FIXTURES["speed_bench_coding"]))
    assert len(coding.conversations) == 2 and coding.placeholders == 1 and coding.filtered == 1
    assert coding.conversations[1] == ["Write a SQL query that counts the rows of a table named orders.",
                                       "Group the count by customer."]
    every = load_conversations("speed_bench_qualitative", str(FIX / FIXTURES["speed_bench_qualitative"]))
    assert len(every.conversations) == 3 and every.placeholders == 1 and every.filtered == 0
    with pytest.raises(ValueError, match=r"speed_bench_stem.*no usable conversation in 4 row\(s\) \(4 of another "
                                         r"category, 0 without text\)"):
        load_conversations("speed_bench_stem", str(FIX / FIXTURES["speed_bench_stem"]))


def test_a_set_of_placeholders_only_says_how_to_rebuild_it(tmp_path):
    rows = [json.loads(line) for line in (FIX / FIXTURES["speed_bench_coding"]).read_text().splitlines()]
    p = tmp_path / "placeholders.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows if r["source"] != "fledge-fixture"))
    with pytest.raises(ValueError, match=r"'speed_bench_coding'.*1 without text.*SPEED-Bench's preparation script.*"
                                         r"eval.set_paths.speed_bench_coding="):
        load_conversations("speed_bench_coding", str(p))


def test_speed_bench_rows_rebuilt_by_its_script_are_read(tmp_path):
    """SPEED-Bench's preparation script writes the rebuilt rows with user ``messages`` instead of ``turns``."""
    p = tmp_path / "qualitative.jsonl"
    p.write_text(json.dumps({"question_id": "x", "category": "coding", "messages": [
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]}) + "\n")
    assert load_conversations("speed_bench_coding", str(p)).conversations == [["first", "second"]]


def test_later_turns_follow_the_targets_own_answer(renderer):
    loaded = load_conversations("mt_bench", str(FIX / FIXTURES["mt_bench"]))
    asked = []

    def respond(ids):
        asked.append(ids)
        return f"ANSWER{len(asked)}"

    prompts, info = render_prompts(loaded, renderer, 4096, "truncate", 5, respond)
    assert len(prompts) == 5 and info["conversations"] == 3 and info["later_turns"] == 2  # bounded: 2 + 2 + 1
    assert asked == [prompts[0], prompts[2]]  # each answer is the target's reply to exactly the earlier prompt
    second = renderer.tok.decode(prompts[1])
    assert second.startswith(renderer.tok.decode(prompts[0]))  # the same conversation, continued
    assert second.index("garden party") < second.index("<|assistant|>ANSWER1<|end|>") < second.index("limerick")
    assert second.endswith("<|assistant|>")
    alone, info = render_prompts(loaded, renderer, 4096, "truncate", 5, respond=None)  # negative control
    assert len(alone) == 3 and info["later_turns"] == 0


def test_prompt_length_is_bounded_with_counts(renderer):
    ids = list(range(100))
    assert fit_prompt(ids, 100, "skip") == ids
    cut = fit_prompt(ids, 10, "truncate")
    assert cut == [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]  # the head (template, task) and the tail (question, gen prompt)
    assert fit_prompt(ids, 10, "skip") is None
    loaded = load_conversations("longbench_v2", str(FIX / FIXTURES["longbench_v2"]))
    full, _ = render_prompts(loaded, renderer, 1 << 20, "truncate", 8)
    limit = min(map(len, full)) - 1
    cut, info = render_prompts(loaded, renderer, limit, "truncate", 8)
    assert info["truncated"] == 2 and all(len(p) == limit for p in cut)
    assert renderer.tok.decode(cut[0]).endswith('"The correct answer is (insert answer here)".<|end|>\n<|assistant|>')
    kept, info = render_prompts(loaded, renderer, limit, "skip", 8)
    assert kept == [] and info["skipped_too_long"] == 2
    one, info = render_prompts(loaded, renderer, 1 << 20, "truncate", 1)
    assert len(one) == 1 and info["conversations"] == 1


def test_a_set_that_cannot_be_loaded_is_one_line_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache", raising=False)
    with pytest.raises(ValueError) as e:
        load_conversations("gsm8k")
    msg = str(e.value)
    assert "\n" not in msg and "'gsm8k'" in msg and "openai/gsm8k" in msg and "eval.set_paths.gsm8k=" in msg
    with pytest.raises(ValueError, match=r"eval set 'gsm8k'.*no field\(s\) \['question'\].*openai/gsm8k's own schema"):
        load_conversations("gsm8k", str(FIX / FIXTURES["mt_bench"]))
    with pytest.raises(ValueError, match=r"eval set 'math500'.*no such file"):
        load_conversations("math500", str(tmp_path / "missing.jsonl"))


def test_local_hub_snapshot_and_saved_dataset_dirs(tmp_path, monkeypatch):
    """A downloaded hub snapshot (parquet under the config's folder) and a save_to_disk dir load with datasets."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache", raising=False)
    rows = [json.loads(line) for line in (FIX / FIXTURES["gsm8k"]).read_text().splitlines()]
    (tmp_path / "snap/main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "snap/main/test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "snap/main/train-00000-of-00001.parquet")
    snap = load_conversations("gsm8k", str(tmp_path / "snap"))
    assert len(snap.conversations) == 3 and "A baker" in snap.conversations[0][0]  # the test split, not train
    # As the Hub serves it: the README's configs name each config's files (here the other config is first)
    (tmp_path / "snap/socratic").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "snap/socratic/test-00000-of-00001.parquet")
    (tmp_path / "snap/README.md").write_text(
        "---\nconfigs:\n- config_name: socratic\n  data_files:\n  - split: test\n    path: socratic/test-*\n"
        "- config_name: main\n  data_files:\n  - split: test\n    path: main/test-*\n  - split: train\n"
        "    path: main/train-*\n---\n# GSM8K\n")
    card = load_conversations("gsm8k", str(tmp_path / "snap"))
    assert card.conversations == snap.conversations and card.source.endswith("(main, test)")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert load_conversations("gsm8k", str(tmp_path / "saved")).conversations == snap.conversations


def test_unknown_names_are_config_errors():
    check_set_names(["default", "long", "mt_bench", "speed_bench_throughput_16k"],
                    {"longbench_v2": str(FIX / FIXTURES["longbench_v2"]), "gsm8k": "openai/gsm8k@main"})
    with pytest.raises(ValueError, match=r"eval.set_paths.math500=/nonexistent/m.jsonl: no such file"):
        check_set_names(["math500"], {"math500": "/nonexistent/m.jsonl"})
    with pytest.raises(ValueError, match=r"eval.sets='mtbench': expected one of \['default', 'perturbed', 'long', "):
        check_set_names(["default", "mtbench"])
    with pytest.raises(ValueError, match=r"eval.set_paths.default: not a named eval set"):
        check_set_names(["default"], {"default": "/x"})


def test_config_keys():
    from fledge.conf import compose

    cfg = compose(["recipe=tiny", "eval.sets=[mt_bench]", f"+eval.set_paths.mt_bench={FIX / FIXTURES['mt_bench']}",
                   "eval.prompt_length_policy=skip", "eval.max_prompt_tokens=300"])
    assert cfg.eval.set_paths == {"mt_bench": str(FIX / FIXTURES["mt_bench"])} and cfg.eval.max_prompt_tokens == 300
    assert "longbench_v2" in compose(["recipe=llama3", "evalsets=long_context"]).eval.sets
    assert compose(["recipe=tiny", "evalsets=standard"]).eval.sets[3:] == [
        "mt_bench", "gsm8k", "humaneval", "alpaca", "cnn_dm", "math500", "speed_bench_qualitative"]
    with pytest.raises(ValueError, match="eval.prompt_length_policy='cut'"):
        compose(["recipe=tiny", "eval.prompt_length_policy=cut"])


def test_eval_stage_reports_named_sets(run, tmp_path, monkeypatch):
    """The eval stage on named sets: per-set in-process AL, the later MT-Bench turn asked after the target's own
    answer, and where each set came from, in report.json and report.md (the plots are test_evaluate's)."""
    import fledge.evaluation.evaluate as E
    import fledge.evaluation.report as R

    monkeypatch.setattr(R, "plot_report", lambda *a, **k: [])
    cfg = eval_cfg(run)
    cfg.eval.sets = ["mt_bench", "speed_bench_coding"]
    cfg.eval.set_paths = {"mt_bench": str(FIX / FIXTURES["mt_bench"]),
                          "speed_bench_coding": str(FIX / FIXTURES["speed_bench_coding"])}
    cfg.eval.num_prompts, cfg.eval.temperature, cfg.eval.heldout_steps, cfg.eval.max_new_tokens = 2, 0.0, 1, 8
    cfg.eval.max_prompt_tokens, cfg.eval.drift_depth = 200, 1
    out = tmp_path / "eval"
    summary = E.evaluate_run(eval_inputs(cfg), RunLayout(run / "run").prepare, EvalDir(out), run / "run/export/drafter",
                             torch.device("cpu"))
    report = json.loads((out / "report.json").read_text())
    assert list(report["sets"]) == ["mt_bench", "speed_bench_coding"]
    for name in ("mt_bench", "speed_bench_coding"):
        s = report["sets"][name]
        assert s["prompts"] == 2 and 1.0 <= s["drafter"]["al"] <= 4.0 and summary[f"al_{name}"] == s["drafter"]["al"]
    n = report["named_sets"]
    assert n["mt_bench"]["later_turns"] == 1 and n["mt_bench"]["conversations"] == 1
    coding = n["speed_bench_coding"]
    assert coding["placeholder_rows"] == 1 and coding["hub_id"] == "nvidia/SPEED-Bench"
    md = (out / "report.md").read_text()
    assert "## Named eval sets" in md and "| mt_bench | multi-turn chat" in md


def test_entry_point_refuses_an_unknown_set_before_any_stage(tmp_path):
    from tests.helpers.cli import assert_one_line, fledge_run

    assert_one_line(fledge_run(tmp_path, "eval.sets=[default,mtbench]"), "config: eval.sets='mtbench': expected one of",
                    "mt_bench", "evaluation/eval_sets.py")
    assert not (tmp_path / "out").exists()


def test_a_named_set_not_readable_here_is_refused_before_any_stage(monkeypatch):
    """Offline, a named set needs an installed copy or eval.set_paths: found out before the training, not after."""
    from fledge.evaluation import eval_sets
    from fledge.evaluation.eval_sets import check_reachable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(eval_sets.packaged, "available", lambda path: False)
    with pytest.raises(ValueError, match=r"eval set 'mt_bench'.*\+eval.set_paths.mt_bench=PATH"):
        check_reachable(["default", "mt_bench"])
    with pytest.raises(ValueError, match="eval set 'gsm8k'"):
        check_reachable(["gsm8k"])  # no package ships it: only a path or the Hub
    check_reachable(["default", "mt_bench"], {"mt_bench": "/data/question.jsonl"})
    monkeypatch.setattr(eval_sets.packaged, "available", lambda path: True)
    check_reachable(["mt_bench", "humaneval"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(eval_sets.packaged, "available", lambda path: False)
    check_reachable(["gsm8k"])  # online: the Hub is asked when the eval runs
