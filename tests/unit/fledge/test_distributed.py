"""Fledge's own collectives run on the process group's device, whoever built the tensors.

NCCL takes CUDA tensors only, so a flag or a metric sum built on the CPU (``torch.tensor(...)``,
``.cpu()``) crashes a multi-GPU run at its first step, while gloo, which CI runs, takes anything. These
tests stand a second device in for CUDA: the lazy-tensor device (torch's TorchScript lazy backend, which
holds real data on a CPU-only build), and replace torch.distributed's collectives by a two-rank fake that
refuses any tensor not on it. The last test keeps every collective inside fledge/distributed.py.
"""

from __future__ import annotations

import ast

import pytest
import torch
import torch.distributed as dist

import fledge.distributed as fd
from fledge.train.metrics import RatioMeter
from tests.helpers.paths import REPO as ROOT


@pytest.fixture(scope="module")
def lazy_device() -> torch.device:
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy", 0)


@pytest.fixture
def two_ranks(monkeypatch, lazy_device):
    """A fake world of two ranks holding the same values, whose collectives take ``lazy`` tensors only."""
    calls: list[str] = []

    def on_device(name, t):
        assert t.device == lazy_device, f"a {t.device} tensor reached dist.{name}; NCCL would refuse it"
        calls.append(name)

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        on_device("all_reduce", t)
        t.mul_(2)  # rank 1 holds what rank 0 holds

    def broadcast_object_list(objs, src=0, group=None, device=None):
        assert device is not None and torch.device(device) == lazy_device, \
            f"broadcast_object_list would stage its bytes on {device}"
        calls.append("broadcast_object_list")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    # raising=False: on a fledge.distributed without the helper, the device check below is what fails
    monkeypatch.setattr(fd, "collective_device", lambda: lazy_device, raising=False)
    return calls


def test_all_reduce_sum_runs_on_the_group_device_and_returns_on_the_callers(two_ranks):
    x = torch.tensor([1.0, 2.5])  # built on the CPU, as trainer flags are
    out = fd.all_reduce_sum(x)
    assert two_ranks == ["all_reduce"]
    assert out.device == x.device and out.tolist() == [2.0, 5.0]
    assert x.tolist() == [1.0, 2.5]  # the caller's tensor is not reduced in place


def test_any_rank_takes_bools_and_tensors(two_ranks):
    assert fd.any_rank(True) and not fd.any_rank(False)
    assert fd.any_rank(~torch.isfinite(torch.tensor([1.0, float("nan")]))).__class__ is bool
    assert not fd.any_rank(torch.tensor([False, False]))
    assert two_ranks == ["all_reduce"] * 4


def test_broadcast_object_stages_on_the_group_device(two_ranks):
    assert fd.broadcast_object({"a": 1}) == {"a": 1}
    assert two_ranks == ["broadcast_object_list"]


def test_metrics_reduce_through_the_group_device(two_ranks):
    """RatioMeter (the trainer's metrics) sums per micro-batch wherever the loss put them, then reduces."""
    meter = RatioMeter()
    meter.add({"acc_0": (torch.tensor([1.0, 0.0, 1.0]), torch.tensor(3.0))})
    meter.add({"acc_0": (torch.tensor(2.0), 2)})
    assert meter.reduce() == {"acc_0": pytest.approx(4 / 5)}
    assert two_ranks == ["all_reduce"]


def test_collective_device_follows_the_backend(monkeypatch):
    """NCCL: the current CUDA device (init_world sets LOCAL_RANK's); barrier names it; gloo: the CPU."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert fd.collective_device() == torch.device("cuda", 3)
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda group=None, async_op=False, device_ids=None: seen.append(device_ids))
    fd.World(rank=0, world_size=2, local_rank=3, device=torch.device("cuda", 3)).barrier()
    assert seen == [[3]]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert fd.collective_device() == torch.device("cpu")


# torchrun's agent (pipeline/torchrun.py runs it in Fledge's process): it starts the ranks and calls no collective
LAUNCHER = ("torch.distributed.run", "torch.distributed.elastic")


def _uses_torch_distributed(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(LAUNCHER) and (
                node.module.startswith("torch.distributed")
                or (node.module == "torch" and any(a.name == "distributed" for a in node.names))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            lines.append(node.lineno)
    return lines


def test_only_fledge_distributed_touches_torch_distributed():
    """A collective called elsewhere would bypass the device rule above (and a CPU tensor would crash
    NCCL); DeepSpeed's own collectives are DeepSpeed's business."""
    offenders = []
    for pkg in ("pipeline", "train", "data", "models", "conf", "fledge"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "fledge/distributed.py" or path.is_symlink() or rel.startswith("fledge/") and \
                    rel.split("/")[1] in ("train", "data", "models", "conf"):
                continue
            lines = _uses_torch_distributed(ast.parse(path.read_text(), rel))
            offenders += [f"{rel}:{n}" for n in lines]
    assert not offenders, f"torch.distributed used outside fledge/distributed.py: {offenders}"
    assert _uses_torch_distributed(ast.parse((ROOT / "fledge" / "distributed.py").read_text()))  # the scan works


_WORLD_OF_ONE = """
import os, socket, sys
import torch.distributed as dist
from fledge.distributed import init_world
world = init_world()
port = int(os.environ["MASTER_PORT"])
with socket.socket() as s:  # the store holds its port: nobody else can bind it
    try:
        s.bind((os.environ["MASTER_ADDR"], port))
        sys.exit(f"port {port} was free after init_world")
    except OSError:
        pass
assert (world.rank, world.world_size, dist.get_world_size()) == (0, 1, 1)
print("ok", port)
"""


def test_a_world_of_one_holds_its_own_port_whatever_port_it_inherits():
    """A world of one binds its store's port as the OS picks it and ignores an inherited MASTER_PORT: a run
    started by a process that ran one in-process inherits RANK=0, WORLD_SIZE=1 and a MASTER_PORT that process
    still holds (CI's EADDRINUSE), and runs started side by side cannot take each other's port."""
    import os
    import socket
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        inherited = dict(clean, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(held.getsockname()[1]))
        procs = [subprocess.Popen([sys.executable, "-c", _WORLD_OF_ONE], env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for env in (clean, clean, inherited)]
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    ports = [int(out.split()[1]) for out, _ in outs]
    assert len(set(ports)) == 3 and int(inherited["MASTER_PORT"]) not in ports
