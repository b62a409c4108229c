"""Process-group setup shared by every stage.

The world comes from the environment torchrun (or ``srun torchrun``) sets: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT. A plain ``python train/main.py`` becomes a world of one, so the stages
and DeepSpeed see the same kind of process group everywhere. The device is chosen here, never in
library code: CUDA ``LOCAL_RANK`` when present, else the CPU (gloo).
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
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(timeout_minutes: int = 120) -> World:
    """Initialise (once) the default process group from the environment and pick the device."""
    if "RANK" not in os.environ:  # not under a launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
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
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes), device_id=None
        )
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def setup_logging(world: World) -> None:
    """Rank 0 logs INFO; the others only warnings, prefixed with their rank."""
    level = logging.INFO if world.is_main else logging.WARNING
    fmt = f"[%(asctime)s rank{world.rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (no-op for a world of one); used for exact metric reduction."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from ``src`` to every rank (only our own in-memory objects)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
