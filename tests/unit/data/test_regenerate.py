"""Regeneration against a loopback OpenAI-compatible stub and in-process on a tiny random Llama."""

import json
import signal
import subprocess
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
    server_errors = {}  # user content -> how many more times it gets HTTP 503 before an answer
    delay_s = 0.0  # each answer takes this long
    calls = []
    auth = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.calls.append(body)
        Stub.auth.append(self.headers.get("Authorization"))
        last = body["messages"][-1]["content"]
        if Stub.server_errors.get(last):
            Stub.server_errors[last] -= 1
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": "engine overloaded"}' + b" " * 400 + b"END")
            return
        time.sleep(Stub.delay_s)
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
    Stub.fail_on, Stub.too_long, Stub.server_errors, Stub.delay_s, Stub.calls = set(), set(), {}, 0.0, []
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


def test_a_server_error_is_retried_and_the_error_quotes_the_servers_reply(server, tmp_path):
    """HTTP 5xx (an overloaded or restarting server) is retried with backoff, a bounded number of times; when the
    retries run out the error quotes the server's reply (cut short), never the request's private text."""
    be = OpenAIBackend(server, "m", retries=3, backoff_s=0.01)
    Stub.server_errors = {"q0": 2}
    assert be.complete([{"role": "user", "content": "q0"}], 0.0, 4)["content"] == "re:q0|t=0.0"
    assert len(Stub.calls) == 3
    Stub.server_errors, Stub.calls = {"my private question": 99}, []
    with pytest.raises(RuntimeError) as e:
        be.complete([{"role": "user", "content": "my private question"}], 0.0, 4)
    msg = str(e.value)
    assert len(Stub.calls) == 4 and "HTTP 503" in msg and "engine overloaded" in msg, msg
    assert "my private question" not in msg and "END" not in msg and len(msg) < 500, msg  # the reply, truncated
    Stub.fail_on, Stub.calls = {"bad"}, []
    with pytest.raises(RuntimeError, match="HTTP 400"):  # our request is wrong: no retry answers it
        be.complete([{"role": "user", "content": "bad"}], 0.0, 4)
    assert len(Stub.calls) == 1


# ---- stop signals: every conversation finished is kept, nothing more is sent, no process survives ---------------

STOPS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def _input(tmp_path, n=20):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"messages": c["messages"]}) for c in _convs(n)) + "\n")
    return src


def _start(argv):
    """The real command, in a session of its own (as a shell's job: a signal reaches it alone)."""
    return subprocess.Popen([sys.executable, "-m", "fledge", "regenerate", *map(str, argv)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_answers(proc, out, n, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while len(done_indices(out)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"regenerate never wrote {n} answers:\n{proc.communicate()[1]}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stopped(proc, sig, out, timeout_s=60):
    """Send ``sig``; the command's stderr once it has exited with 128 + sig and one line saying how to resume."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"regenerate still running {timeout_s} s after {sig.name}:\n{proc.communicate()[1]}")
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    resume = [line for line in err.splitlines() if "rerun" in line]
    assert len(resume) == 1 and sig.name in resume[0] and str(out) in resume[0], err
    lines = out.read_text().splitlines()
    assert len(lines) == len(done_indices(out)) == len({json.loads(x)["index"] for x in lines})  # whole, once each
    return err


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_stop_signal_sends_nothing_more_keeps_every_answer_and_says_how_to_resume(server, tmp_path, sig):
    """Ctrl-C (or SIGTERM, SIGHUP) on `fledge regenerate --endpoint`: nothing more is sent (the queued conversations
    are dropped at once, not sent one by one for hours), every answer finished is in the output, the exit code is
    128 + the signal's, one line says how to resume, and resuming answers exactly the rest."""
    Stub.delay_s = 0.2
    out = tmp_path / "o.jsonl"
    argv = ["--input", _input(tmp_path), "--output", out, "--endpoint", server, "--model", "m", "--concurrency", "2"]
    proc = _start(argv)
    _wait_for_answers(proc, out, 4)
    kept_before, sent = len(done_indices(out)), len(Stub.calls)
    _stopped(proc, sig, out)
    time.sleep(0.5)
    assert len(Stub.calls) <= sent + 2, "conversations were still sent after the signal"
    kept = done_indices(out)
    assert kept_before <= len(kept) < 20
    Stub.delay_s, Stub.calls = 0.0, []
    res = subprocess.run([sys.executable, "-m", "fledge", "regenerate", *map(str, argv)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert done_indices(out) == set(range(20)) and len(out.read_text().splitlines()) == 20
    assert len(Stub.calls) == 2 * (20 - len(kept))  # two turns each, only the conversations not kept


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_stop_signal_on_serve_ends_the_server_and_keeps_every_answer(tmp_path, monkeypatch, sig):
    """`fledge regenerate --serve` stopped by any of the three signals: the server it started (and the server's
    engine process) ends with it, whatever the signal (SIGTERM and SIGHUP used to leave it running, holding the
    GPUs), and the answers finished are kept."""
    from tests.helpers.processes import descendants

    model = _fake_engine_python(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_SERVER_ANSWER_S", "0.2")
    out = tmp_path / "o.jsonl"
    proc = _start(["--input", _input(tmp_path), "--output", out, "--serve", model, "--concurrency", "2",
                   "--max-turns", "1"])
    _wait_for_answers(proc, out, 3)
    ours = [proc.pid, *descendants(proc.pid)]
    seen = json.loads((tmp_path / "server.json").read_text())
    assert {seen["pid"], seen["child"]} <= set(ours)
    _stopped(proc, sig, out)
    left = [pid for pid in ours if _alive(pid)]
    assert not left, f"processes of regenerate outlived it: {left}"
    assert 3 <= len(done_indices(out)) < 20


def test_a_process_answering_on_the_servers_port_never_gets_the_key(tmp_path, monkeypatch, capsys):
    """The port --serve picks is free when picked, and the server binds it only later: another local process that
    takes it meanwhile answers /health. Regenerate checks that the port's listener is the server it started before
    it sends the key (and any conversation) there."""
    model = _fake_engine_python(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_SERVER_DELAY_S", "4")  # the real server is slow to bind
    got = []

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            got.append(self.headers.get("Authorization"))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *a):
            pass

    def squat():
        record = tmp_path / "server.json"
        while True:
            try:
                argv = json.loads(record.read_text())["argv"]
                break
            except (OSError, ValueError):
                time.sleep(0.01)
        srv = ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Impostor)
        squatters.append(srv)
        srv.serve_forever()

    squatters = []
    threading.Thread(target=squat, daemon=True).start()
    src = _input(tmp_path, 2)
    try:
        rc = cli.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--serve", str(model)])
    finally:
        for srv in squatters:
            srv.shutdown()
    assert not got, f"the key went to another process: {got}"
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "not the server" in err and len(err.splitlines()) == 1, err
    seen = json.loads((tmp_path / "server.json").read_text())
    assert not _alive(seen["pid"]) and not _alive(seen["child"])
