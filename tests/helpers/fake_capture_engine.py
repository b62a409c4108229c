"""A stand-in for vLLM behind data/capture/vllm_side/capture_driver.py, run by Fledge's own python: the real
driver's ``run_job`` (spools, keys, backpressure, heartbeat) over a fake ``vllm.LLM`` whose states are made
up but pass Fledge's checks: column 0 is the embedding of the tokens, the sampled token is the argmax Fledge
computes from column L, and every other column is a deterministic function of the tokens. For the stream's
protocol tests (tests/unit/data/test_stream_protocol.py, tests/distributed/test_online_stream.py) in seconds;
tests/engine/ runs the real engine. ``FAKE_ENGINE_DIE_ONCE=N:PATH`` kills the engine (SIGKILL) as it is about to
make its N-th batch (from 0), once: PATH, created then, marks it done for the engines started after it.
``FAKE_ENGINE_HANG_AT=N:PATH`` makes it hang instead, as it is about to make its N-th batch (touching PATH), and an
engine started once PATH exists hangs at start-up (a large target loading for longer than any grace period); a
hung engine ends when its parent does. ``FAKE_ENGINE_GPU=PATH``: the engine holds PATH (an exclusive lock) for its
life, as vLLM holds 0.85 of its GPU's memory, and fails at start-up while another engine holds it.

    python fake_capture_engine.py -I DRIVER REQUEST.json RESULT.json     (as fledge/engine_process.py calls it)
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from safetensors.torch import save_file


def fake_states(token_ids: list[int], layer_ids: list[int], embed: torch.Tensor) -> torch.Tensor:
    """[T, n, H]: the embedding at id 0, a deterministic function of the tokens elsewhere."""
    ids = torch.tensor(token_ids)
    cols = []
    for k in layer_ids:
        if k == 0:
            cols.append(embed[ids])
        else:
            g = torch.Generator().manual_seed(1000 * k + int(ids.sum()) % 997)
            cols.append(torch.randn(len(ids), embed.shape[1], generator=g) + 0.01 * ids[:, None].float())
    return torch.stack(cols, dim=1)


def _hang(parent: int) -> None:
    """Make no batch until the parent (the rank, or its launcher) is gone, then exit, as an orphaned driver does."""
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(3)


def _hold_gpu(path: str) -> int:
    """An exclusive lock on ``path`` for this process's life (the fd stays open): the GPU's memory."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(f"fake engine: another engine holds the GPU ({path}); vLLM: not enough free memory "
                           "for gpu_memory_utilization=0.85") from None
    return fd


class FakeLLM:
    def __init__(self, req: dict):
        from fledge.data.capture.engine import TargetHead

        self.parent = os.getppid()
        hang = os.environ.get("FAKE_ENGINE_HANG_AT")
        self.hang_at = int(hang.split(":", 1)[0]) if hang else None
        if hang and os.path.exists(hang.split(":", 1)[1]):
            _hang(self.parent)
        if os.environ.get("FAKE_ENGINE_GPU"):
            self.gpu = _hold_gpu(os.environ["FAKE_ENGINE_GPU"])
        self.req = req
        self.head = TargetHead.load(req["target"], None, float(req.get("fake_eps", 1e-6)), "cpu", torch.float32)
        self.connector = Path(req["connector_dir"])
        self.connector.mkdir(parents=True, exist_ok=True)
        self.delay = float(os.environ.get("FAKE_ENGINE_DELAY_S", "0"))
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(self.delay)
        die = os.environ.get("FAKE_ENGINE_DIE_ONCE")
        if die and self.calls == int(die.split(":", 1)[0]) and not os.path.exists(die.split(":", 1)[1]):
            Path(die.split(":", 1)[1]).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.calls == self.hang_at:
            Path(os.environ["FAKE_ENGINE_HANG_AT"].split(":", 1)[1]).touch()
            _hang(self.parent)
        self.calls += 1
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            states = fake_states(ids, self.req["layer_ids"], self.head.embed)
            last = states[-1:, -1]
            sampled = int(self.head.logits(self.head.final_norm(last))[0].argmax())
            fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self.connector)
            os.close(fd)
            save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, path)
            outs.append(types.SimpleNamespace(kv_transfer_params={"hidden_states_path": path},
                                              outputs=[types.SimpleNamespace(token_ids=[sampled])]))
        return outs


def _install_fake_vllm() -> None:
    """The two names run_job imports from vLLM."""
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1",
             "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules["vllm"].SamplingParams = lambda **kw: kw
    sys.modules[names[-1]].load_hidden_states = lambda path: None


def main(argv: list[str]) -> int:
    driver, req_path, res_path = argv[-3:]
    spec = importlib.util.spec_from_file_location("capture_driver", driver)
    drv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drv)
    drv.PARENT = os.getppid()
    _install_fake_vllm()
    req = json.loads(Path(req_path).read_text())
    drv.OWNER.update(req.get("owner") or {})
    llm = FakeLLM(req)
    out = {"jobs": {job["name"]: drv.run_job(llm, job, req) for job in req["jobs"]}}
    Path(res_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
