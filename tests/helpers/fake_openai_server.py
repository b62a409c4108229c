"""A stand-in for vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server --model M --host H
--port P ...``), started by ``fledge regenerate --serve`` through a fake engine python: answers ``/health`` and
``/v1/chat/completions`` (only with ``Authorization: Bearer $VLLM_API_KEY``; each answer takes
``$FAKE_SERVER_ANSWER_S``), writes its argv, key, pid and a child's pid to ``$FAKE_SERVER_RECORD`` (the child stands
for vLLM's engine core: stopping the server must end it too).

    python fake_openai_server.py -m vllm.entrypoints.openai.api_server --model M --host H --port P [...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {os.environ['VLLM_API_KEY']}":
            self.send_response(401)
            self.end_headers()
            return
        last = body["messages"][-1]["content"]
        time.sleep(float(os.environ.get("FAKE_SERVER_ANSWER_S", "0")))  # a model takes a while to answer
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"{body['model']}:{last}"},
                                         "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *a):
        pass


if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_SERVER_RECORD"], "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "child": child.pid, "key": os.environ["VLLM_API_KEY"]}, f)
    time.sleep(float(os.environ.get("FAKE_SERVER_DELAY_S", "0.5")))  # a server takes a while to answer /health
    ThreadingHTTPServer((arg("--host"), int(arg("--port"))), Handler).serve_forever()
