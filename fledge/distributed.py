"""Process-group setup shared by every stage.

The world comes from the environment torchrun (or ``srun torchrun``) sets: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT. A plain ``python train/main.py`` becomes a world of one, so the stages
and DeepSpeed see the same kind of process group everywhere. The device is chosen here, never in
library code: CUDA ``LOCAL_RANK`` when present, else the CPU (gloo).

Every collective of Fledge's own goes through this module (DeepSpeed runs its own on the device). NCCL
accepts CUDA tensors only, so the helpers below move what callers hand them to :func:`collective_device`
and back: a caller may build its flags and sums on the CPU (or anywhere) without knowing the backend.
tests/unit/fledge/test_distributed.py holds the helpers and the metrics reduction to this with a stand-in device.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op for a world of one)."""
        if dist.is_initialized() and self.world_size > 1:
            device = collective_device()
            # NCCL's barrier is an all-reduce on a device: name ours rather than let torch guess one.
            if device.type == "cuda":
                dist.barrier(device_ids=[device.index])
            else:
                dist.barrier()


def init_world(timeout_minutes: int = 120) -> World:
    """Initialise (once) the default process group from the environment and pick the device."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = None
    if os.environ.get("WORLD_SIZE", "1") == "1" and not dist.is_initialized():
        # A world of one (a plain ``python``, or torchrun with one process) meets nobody: its store is its own,
        # on loopback only, on a port the OS picks as it binds. A port chosen first and bound later went to
        # whatever bound it in between, and a MASTER_PORT inherited from a parent that holds it (a run started
        # from a process that ran one in-process) cannot be bound again: both were EADDRINUSE.
        store = loopback_store(timeout)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(store.port))  # for libraries that read the world from the env
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        # Long timeout: rank 0 alone runs `prepare` while the others wait at a barrier.
        if store is not None:
            # gloo's own listener goes where GLOO_SOCKET_IFNAME says, else to the address the host name has
            ours = "GLOO_SOCKET_IFNAME" not in os.environ
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            try:
                dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
            finally:
                if ours:
                    os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=None)
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def loopback_store(timeout: datetime.timedelta, multi_tenant: bool = False) -> dist.TCPStore:
    """A c10d store server that listens on 127.0.0.1 only, on a port the OS picks as it binds (``.port``).
    TCPStore's own server listens on every interface whatever host it is named, and nothing authenticates
    its clients: anyone who reaches the port could read and write the run's keys, and torchrun's rendezvous
    state, which torch unpickles. ``multi_tenant``: a TCPStore made later in this process on the same port
    (torchrun's agent, pipeline/torchrun.py) shares this server instead of binding its own."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=multi_tenant, master_listen_fd=sock.detach())  # the store owns the socket


def setup_logging(world: World) -> None:
    """Rank 0 logs INFO; the others only warnings, prefixed with their rank."""
    level = logging.INFO if world.is_main else logging.WARNING
    fmt = f"[%(asctime)s rank{world.rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """The device the process group's collectives take tensors on: the current CUDA device under NCCL
    (init_world set it to LOCAL_RANK's), the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The process group's backend (``gloo``, ``nccl``), for libraries that wrap it (DeepSpeed's comm)."""
    return dist.get_backend()


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over ranks (no-op for a world of one); used for exact metric reduction. ``values`` may
    live on any device: the sum runs on :func:`collective_device` and comes back on ``values``' device.
    ``group``: a process group (e.g. a :class:`SequenceGroups` group) instead of the whole world."""
    if not _multi_rank():
        return values
    buf = values.detach().to(collective_device(), copy=True)  # a copy: the caller's tensor stays as it was
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.to(values.device)


def any_rank(flag: bool | torch.Tensor) -> bool:
    """True on every rank when ``flag`` is true on at least one (a bool, or a tensor on any device)."""
    return bool(all_reduce_sum(torch.as_tensor(flag).reshape(-1).to(torch.float32)).sum() > 0)


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from ``src`` to every rank (only our own in-memory objects)."""
    if not _multi_rank():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=collective_device())  # pickled bytes travel as a tensor
    return box[0]


@dataclass(frozen=True)
class SequenceGroups:
    """The world as data parallel x sequence parallel: ``size`` consecutive ranks (one node's, when a node
    holds a multiple of ``size``) share each packed row; ``group`` is this rank's group of them, ``rank`` its
    place there; ``dp_rank`` / ``dp_size`` index the groups, which is what the data loader sees."""

    size: int
    rank: int
    group: object  # a torch ProcessGroup, None when size == 1
    dp_rank: int
    dp_size: int


def check_sequence_parallel(world_size: int, size: int, key: str = "train.sequence_parallel") -> None:
    """ValueError naming ``key`` when ``size`` does not divide the world."""
    if size < 1 or world_size % size:
        raise ValueError(f"{key}={size} does not divide the world of {world_size} rank(s): launch a multiple "
                         f"of {size} processes (world = data parallel x {key}) or set {key} to a divisor of "
                         f"{world_size}")


def sequence_groups(world: World, size: int, key: str = "train.sequence_parallel") -> SequenceGroups:
    """Split the world into groups of ``size`` consecutive ranks (every rank must call this, in step).
    ValueError naming ``key`` when ``size`` does not divide the world."""
    check_sequence_parallel(world.world_size, size, key)
    group = None
    if size > 1:
        for first in range(0, world.world_size, size):  # new_group is collective: every rank makes every group
            g = dist.new_group(list(range(first, first + size)))
            if first <= world.rank < first + size:
                group = g
    return SequenceGroups(size=size, rank=world.rank % size, group=group, dp_rank=world.rank // size,
                          dp_size=world.world_size // size)


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
