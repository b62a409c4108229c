"""Hub upload against a local stub of the Hub API (127.0.0.1): what would be uploaded, retries, refusal."""

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import CARD_SPEC as SPEC, CARD_TARGET as TARGET, random_state_dict
from fledge.models.export import training_record, write_drafter
from fledge.models.hub import build_model_card, push_to_hub
from fledge.models.serving_config import serving_config

TOKEN = "hf_secret_token_for_the_stub"


class Stub(BaseHTTPRequestHandler):
    calls: list = []
    fail_commits = 0

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
        if self.path == "/api/repos/create":
            base = f"http://127.0.0.1:{self.server.server_port}"
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
            base = f"http://127.0.0.1:{self.server.server_port}"
            return self._reply(200, {"commitUrl": f"{base}/org/drafter/commit/abc", "commitOid": "a" * 40})
        return self._reply(404, {"error": self.path})


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as constants

    # conftest sets HF_HUB_OFFLINE=1, which huggingface_hub enforces on every request: lift it for the stub only
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    Stub.calls, Stub.fail_commits = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    config = serving_config(TARGET, SPEC, SPEC["aux_layer_ids"], 64)
    write_drafter(run / "export" / "drafter", random_state_dict(config), config,
                  training_record(SPEC, {"step": 9, "metrics": {"acc_0": 0.61},
                                         "target": {"name_or_path": "org/target-model"}}))
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "manifest.json").write_text(json.dumps({"complete": True, "outputs": {
        "sets": {"default": {"al": 2.875, "accept_rate_1": 0.71}, "perturbed": {"al": 2.5, "accept_rate_1": 0.6}}}}))
    (run / "eval" / "al_per_position.png").write_bytes(b"\x89PNG fake")
    (run / "config.yaml").write_text("data:\n  sources:\n  - path: org/chat-data\n    weight: 1.0\n")
    return run


def _commit_files(calls):
    """{path: bytes} of the files in the (last successful) commit's ndjson payload."""
    body = [b for p, _, b in calls if "/commit/" in p][-1]
    files = {}
    for line in body.decode().splitlines():
        item = json.loads(line)
        if item["key"] == "file":
            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
    return files


def test_model_card_content(run_dir):
    card, plots = build_model_card(run_dir / "export" / "drafter", "org/drafter", run_dir, speculative_tokens=4)
    text = str(card)
    assert card.data.base_model == "org/target-model" and card.data.datasets == ["org/chat-data"]
    assert "vllm serve org/target-model --speculative-config" in text
    assert '"method": "eagle3", "model": "org/drafter", "num_speculative_tokens": 4' in text
    # SGLang would read the hf export's aux ids one layer deeper: no SGLang command, the form it reads named
    assert "--speculative-algorithm EAGLE3" not in text and "export.format=sglang" in text
    assert "| default | 0.710 | 2.875 |" in text and "| perturbed |" in text  # measured AL table
    assert "![al_per_position](eval/al_per_position.png)" in text and [p.name for p in plots] == ["al_per_position.png"]
    assert "EAGLE-3.1" in text and "[2, 3, 4]" in text


def test_push_uploads_export_and_card(hub, run_dir, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    drafter = run_dir / "export" / "drafter"
    url = push_to_hub(drafter, "org/drafter", private=True, run_dir=run_dir, target_config=TARGET,
                      endpoint=hub, base_delay=0.0)
    assert url.endswith("/commit/abc")
    create = [json.loads(b) for p, _, b in Stub.calls if p == "/api/repos/create"][0]
    assert create["name"] == "drafter" and create["organization"] == "org" and create["visibility"] == "private"
    assert all(auth == f"Bearer {TOKEN}" for _, auth, _ in Stub.calls)  # token from the environment
    files = _commit_files(Stub.calls)
    assert set(files) == {"config.json", "model.safetensors", "fledge_training.json", "README.md",
                          "eval/al_per_position.png"}
    assert files["config.json"] == (drafter / "config.json").read_bytes()
    assert files["model.safetensors"] == (drafter / "model.safetensors").read_bytes()
    assert b"vllm serve org/target-model --speculative-config" in files["README.md"]
    out = capsys.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out.out + out.err  # never printed or logged


def test_push_retries_transient_errors(hub, run_dir):
    Stub.fail_commits = 2
    url = push_to_hub(run_dir / "export" / "drafter", "org/drafter", private=False, target_config=TARGET,
                      endpoint=hub, base_delay=0.0)
    assert url.endswith("/commit/abc")
    create = [json.loads(b) for p, _, b in Stub.calls if p == "/api/repos/create"][0]
    assert create["visibility"] == "public"
    # huggingface_hub may itself retry a 503 once or more; either way the upload ends committed
    assert sum("/commit/" in p for p, _, _ in Stub.calls) >= 3


def test_push_refuses_lint_failures(hub, run_dir):
    drafter = run_dir / "export" / "drafter"
    c = json.loads((drafter / "config.json").read_text())
    c["max_position_embeddings"] = 512
    (drafter / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="fails the linter"):
        push_to_hub(drafter, "org/drafter", target_config=TARGET, endpoint=hub, base_delay=0.0)
    assert Stub.calls == []  # nothing was sent
