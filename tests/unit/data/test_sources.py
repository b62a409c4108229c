"""Loading and normalising chat rows: file kinds, ShareGPT / OpenAI forms, thinking, tools, bad input."""

import json

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
