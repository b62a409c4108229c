"""A local stand-in for the Hugging Face Hub API (127.0.0.1) that records what a push sends; tests point
huggingface_hub at it (an endpoint argument, or HF_ENDPOINT for a pipeline run in a subprocess), so no test
reaches the network."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Stub(BaseHTTPRequestHandler):
    calls: list = []  # (path, authorization header, body) of every POST
    fail_commits = 0  # answer this many commits with 503 first
    private: bool | None = None  # the repo's visibility: None until created (a test sets it for an existing repo)
    refuse: int | None = None  # answer every request with this HTTP status (401, 403, 404, ...)

    def log_message(self, *args):
        pass

    def _reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Stub.calls.append((self.path, self.headers.get("authorization"), body))
        if Stub.refuse:
            return self._reply(Stub.refuse, {"error": f"refused ({Stub.refuse})"})
        base = f"http://127.0.0.1:{self.server.server_port}"
        if self.path == "/api/repos/create":
            if Stub.private is None:  # create_repo(exist_ok=True) leaves an existing repo as it is
                Stub.private = json.loads(body).get("visibility", "private") == "private"
            return self._reply(200, {"url": f"{base}/org/drafter", "name": "org/drafter"})
        if self.path == "/api/validate-yaml":
            return self._reply(200, {})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if "/commit/" in self.path:
            if Stub.fail_commits:
                Stub.fail_commits -= 1
                return self._reply(503, {"error": "try again"})
            return self._reply(200, {"commitUrl": f"{base}/org/drafter/commit/abc", "commitOid": "a" * 40})
        return self._reply(404, {"error": self.path})

    def do_GET(self):
        if Stub.refuse:
            return self._reply(Stub.refuse, {"error": f"refused ({Stub.refuse})"})
        if self.path.startswith("/api/models/org/drafter") and Stub.private is not None:
            return self._reply(200, {"id": "org/drafter", "private": Stub.private, "sha": "a" * 40})
        return self._reply(404, {"error": self.path})


@contextmanager
def serve() -> Iterator[str]:
    """Run the stub on a free port (its recorded calls cleared); yields its base URL."""
    Stub.calls, Stub.fail_commits, Stub.private, Stub.refuse = [], 0, None, None
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def commit_files(calls: list) -> dict[str, bytes]:
    """{path: bytes} of the files in the last commit's ndjson payload."""
    body = [b for p, _, b in calls if "/commit/" in p][-1]
    files = {}
    for line in body.decode().splitlines():
        item = json.loads(line)
        if item["key"] == "file":
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
    return files
