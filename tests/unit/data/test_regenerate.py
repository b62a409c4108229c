"""Regeneration against a loopback OpenAI-compatible stub and in-process on a tiny random Llama."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fledge.data.prepare import regenerate as cli
from fledge.data.prepare.regenerate import OpenAIBackend, TransformersBackend, done_indices, regenerate


class Stub(BaseHTTPRequestHandler):
    fail_on = set()  # user contents that get HTTP 400
    too_long = set()  # user contents that get vLLM's HTTP 400 for a prompt longer than its context
    calls = []
    auth = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.calls.append(body)
        Stub.auth.append(self.headers.get("Authorization"))
        last = body["messages"][-1]["content"]
        if last in Stub.too_long:  # vLLM's answer to a prompt past --max-model-len
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "This model\'s maximum context length is 2048 tokens."}}')
            return
        if self.path != "/v1/chat/completions" or last in Stub.fail_on:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad"}')
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": f"re:{last}|t={body['temperature']}"},
                              "finish_reason": "stop"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture()
def server():
    Stub.fail_on, Stub.too_long, Stub.calls = set(), set(), []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def _convs(n):
    return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"},
                          {"role": "user", "content": f"p{i}"}, {"role": "assistant", "content": "old"}],
             "source": "s", "index": i} for i in range(n)]


def test_endpoint_resume_and_record(server, tmp_path):
    out = tmp_path / "regen.jsonl"
    Stub.fail_on = {"q3"}
    be = OpenAIBackend(server, "tgt", retries=0)
    s = regenerate(_convs(6), out, be, temperature=0.7, max_tokens=9, concurrency=3, progress=False)
    assert s["done"] == 5 and s["failed"] == 1
    assert "index 3" in s["first_errors"][0] and "HTTP 400" in s["first_errors"][0]
    assert done_indices(out) == {0, 1, 2, 4, 5}
    with open(out, "a") as f:
        f.write('{"index": 9, "mess')  # a torn line from a kill
    Stub.fail_on, Stub.calls = set(), []
    s = regenerate(_convs(6), out, be, temperature=0.7, max_tokens=9, progress=False)
    assert s == {"done": 1, "skipped_existing": 5, "too_long": 0, "failed": 0, "first_errors": []}
    assert len(Stub.calls) == 2  # only conversation 3's two turns
    recs = {}
    for line in out.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        recs[r["index"]] = r
    r = recs[3]
    assert [m["content"] for m in r["messages"]] == ["q3", "re:q3|t=0.7", "p3", "re:p3|t=0.7"]
    assert r["regenerated"] == {"model": "tgt", "temperature": 0.7, "max_tokens": 9, "turns": 2,
                                "finish_reasons": ["stop", "stop"]}
    # The second turn saw the regenerated first answer, not the old one.
    assert Stub.calls[1]["messages"][1]["content"] == "re:q3|t=0.7" and Stub.calls[1]["max_tokens"] == 9


def test_cli(server, tmp_path, monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "sk-from-env")
    Stub.auth.clear()
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"messages": c["messages"]}) for c in _convs(3)) + "\n{bad\n")
    out = tmp_path / "o.jsonl"
    rc = cli.main(["--input", str(src), "--output", str(out), "--endpoint", server, "--model", "m",
                   "--concurrency", "2"])
    assert rc == 0 and done_indices(out) == {0, 1, 2}
    assert Stub.auth and set(Stub.auth) == {"Bearer sk-from-env"}  # the key travels from the environment


def test_cli_refuses_a_key_on_the_command_line(tmp_path, capsys):
    """A key in argv is visible to every user of the machine (ps): refused, pointing at the variable."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--input", "x.jsonl", "--output", str(tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9/v1",
                  "--model", "m", "--api-key", "sk-secret"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert cli.API_KEY_ENV in err and "sk-secret" not in err


def test_in_process_tiny_llama(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.chat_templates import CHATML, make_tokenizer

    tok = make_tokenizer(CHATML, eos="<|im_end|>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=256)).eval()
    be = TransformersBackend(model, tok, name="tiny")
    s = regenerate(_convs(2), tmp_path / "r.jsonl", be, max_tokens=4, concurrency=2, progress=False)
    assert s["done"] == 2
    rec = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    # Greedy decoding of the same prompt reproduces the recorded answer.
    prompt = tok.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt")["input_ids"]
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=4,
                         pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:]
    assert rec["messages"][1]["content"] == tok.decode(ref, skip_special_tokens=True)
    assert rec["regenerated"]["turns"] == 2 and rec["messages"][1]["content"] != "old"


def _fake_engine_python(tmp_path, monkeypatch):
    """An engine python whose ``-m vllm.entrypoints.openai.api_server`` is tests/helpers/fake_openai_server.py."""
    from tests.helpers.paths import REPO

    py = tmp_path / "engine-python"
    py.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{REPO / "tests/helpers/fake_openai_server.py"}" '
                  '-m vllm.entrypoints.openai.api_server "$@"\n')
    py.chmod(0o755)
    monkeypatch.setenv("FLEDGE_ENGINE_PYTHON", str(py))
    monkeypatch.setenv("FAKE_SERVER_RECORD", str(tmp_path / "server.json"))
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_serve_starts_a_keyed_loopback_server_regenerates_and_ends_its_processes(tmp_path, monkeypatch):
    """--serve: vLLM's server on 127.0.0.1 with a fresh key that is never on its command line, the first
    --max-turns turns re-answered through it, and the server's whole process group ended afterwards."""
    model = _fake_engine_python(tmp_path, monkeypatch)
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"messages": c["messages"]}) for c in _convs(3)) + "\n")
    out = tmp_path / "o.jsonl"
    rc = cli.main(["--input", str(src), "--output", str(out), "--serve", str(model), "--max-turns", "1",
                   "--server-args", "--dtype float32"])
    assert rc == 0 and done_indices(out) == {0, 1, 2}
    rec = next(r for r in map(json.loads, out.read_text().splitlines()) if r["index"] == 0)  # in finishing order
    assert [m["content"] for m in rec["messages"]] == ["q0", f"{model}:q0"]  # cut after the first answer
    assert rec["regenerated"]["turns"] == 1
    seen = json.loads((tmp_path / "server.json").read_text())
    argv = seen["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[-2:] == ["--dtype", "float32"]
    assert len(seen["key"]) >= 32 and not any(seen["key"] in a for a in argv)  # in the environment only
    assert "--api-key" not in argv
    deadline = time.monotonic() + 5
    while Path(f"/proc/{seen['child']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{seen['child']}").exists(), "the server's engine process outlived the run"
    assert (tmp_path / "o.jsonl.server.log").exists()


def test_serve_without_an_engine_or_a_model_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEDGE_ENGINE_PYTHON", str(tmp_path / "nope" / "python"))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": _convs(1)[0]["messages"]}) + "\n")
    assert cli.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "setup_engine.sh" in err and len(err.splitlines()) == 1
    model = _fake_engine_python(tmp_path, monkeypatch)
    assert cli.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--serve", str(model / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_conversation_past_the_servers_context_is_skipped_not_failed(server, tmp_path):
    """vLLM refuses a prompt longer than --max-model-len with HTTP 400: no retry answers it, so it is counted
    apart (too_long) and does not make the run's exit code a failure that a rerun would only repeat."""
    Stub.too_long = {"p1"}  # conversation 1's second turn
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"messages": c["messages"]}) for c in _convs(3)) + "\n")
    out = tmp_path / "o.jsonl"
    rc = cli.main(["--input", str(src), "--output", str(out), "--endpoint", server, "--model", "m"])
    assert rc == 0 and done_indices(out) == {0, 2}
    s = regenerate(_convs(3), out, OpenAIBackend(server, "m", retries=0), progress=False)
    assert s == {"done": 0, "skipped_existing": 2, "too_long": 1, "failed": 0, "first_errors": []}
