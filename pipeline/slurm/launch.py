"""Slurm -> torchrun: ``srun python -m fledge.pipeline.slurm.launch fledge.train.main recipe=NAME [overrides]``.

Under Slurm, srun starts ONE task per node running this module; it reads the SLURM_* variables, works
out the rendezvous (first node of the allocation, node rank, nodes, workers per node) and execs
``python -m fledge.pipeline.torchrun`` (torchrun's agent; a failed rank's one-line error is not followed by
torchrun's traceback) with a c10d rendezvous, so each node's torchrun agent starts one worker per GPU and sets
RANK/LOCAL_RANK/WORLD_SIZE exactly as on a workstation. train/ never reads
SLURM_* itself: the single-node command and the Slurm one run the same code.

Why one torchrun per node and not one srun task per GPU: torchrun forwards SIGTERM to the workers
with a grace period (the trainer checkpoints on it), handles LOCAL_RANK/LOCAL_WORLD_SIZE without any
``--gpu-bind`` setup, and c10d needs no agreed node rank, so nodes that start seconds apart still meet.

Pure standard library (no torch import) so it is fast and unit-testable without Slurm.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 20000  # job id -> port in [20000, 40000): two jobs sharing a node differ


def expand_nodelist(spec: str) -> list[str]:
    """Expand a Slurm host list: ``gpu[01-04,07]``, ``a[1-2],b3``, ``node-[001-003]``, ``r[1-2]n[1-2]``.

    Zero padding follows the range's first number (``n[08-10]`` -> n08 n09 n10), as Slurm does.
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("empty Slurm node list (SLURM_JOB_NODELIST is set but empty)")
    hosts: list[str] = []
    for entry in _split_top_level(spec):
        hosts.extend(_expand_entry(entry, spec))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    """Split on commas outside brackets (``a[1,3],b`` -> ``a[1,3]``, ``b``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"Slurm node list {spec!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"Slurm node list {spec!r}: unbalanced brackets")
    parts.append(spec[start:])
    if any(not p for p in parts):
        raise ValueError(f"Slurm node list {spec!r}: empty entry between commas")
    return parts


def _expand_entry(entry: str, spec: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", entry)
    if m is None:
        if "[" in entry or "]" in entry:
            raise ValueError(f"Slurm node list {spec!r}: cannot parse {entry!r}")
        return [entry]
    prefix, ranges, rest = m.groups()
    tails = _expand_entry(rest, spec) if rest else [""]  # several bracket groups: cartesian product
    return [prefix + num + tail for num in _expand_ranges(ranges, spec) for tail in tails]


def _expand_ranges(ranges: str, spec: str) -> list[str]:
    out = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise ValueError(f"Slurm node list {spec!r}: bad range {item!r} (expected N or N-M)")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"Slurm node list {spec!r}: range {item!r} runs backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node's torchrun agent meets the others."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    job_id: str
    restart_count: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def torchrun_args(self, backend: str = "c10d") -> list[str]:
        """torchrun's rendezvous flags; c10d ignores node rank (ranks come from the rendezvous)."""
        args = [f"--nnodes={self.nnodes}", f"--nproc_per_node={self.nproc_per_node}"]
        if backend == "c10d":
            return args + ["--rdzv_backend=c10d", f"--rdzv_endpoint={self.master_addr}:{self.master_port}",
                           f"--rdzv_id=fledge-{self.job_id}"]
        if backend == "static":
            return args + [f"--node_rank={self.node_rank}", f"--master_addr={self.master_addr}",
                           f"--master_port={self.master_port}"]
        raise ValueError(f"--rdzv-backend={backend!r}: expected c10d or static")


def _count_gres(value: str) -> int:
    """GPU count from SLURM_GPUS_PER_NODE forms: ``8``, ``h100:8``, ``gpu:h100:8(IDX:0-7)``, ``a:2,b:2``."""
    total = 0
    for item in value.split(","):
        field = re.sub(r"\(.*\)$", "", item.strip()).split(":")[-1]
        if not field.isdigit():
            raise ValueError(f"SLURM_GPUS_PER_NODE={value!r}: cannot read a GPU count from {item!r}")
        total += int(field)
    return total


def _tasks_per_node(value: str) -> list[int]:
    """``1(x4),2`` -> [1, 1, 1, 1, 2] (SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE form)."""
    out = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"tasks-per-node value {value!r}: cannot parse {item!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def nproc_per_node(env: Mapping[str, str], override: int | None = None) -> int:
    """Workers per node: an explicit value, else this node's GPUs as Slurm reports them, else 1 (CPU)."""
    if override is not None:
        if override < 1:
            raise ValueError(f"--nproc-per-node={override}: must be >= 1")
        return override
    if env.get("SLURM_GPUS_ON_NODE", "").strip().isdigit() and int(env["SLURM_GPUS_ON_NODE"]) > 0:
        return int(env["SLURM_GPUS_ON_NODE"])
    if env.get("SLURM_GPUS_PER_NODE"):
        n = _count_gres(env["SLURM_GPUS_PER_NODE"])
        if n > 0:
            return n
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        ids = [x for x in env.get(key, "").split(",") if x.strip()]
        if ids and ids != ["NoDevFiles"]:
            return len(ids)
    return 1


def from_slurm_env(env: Mapping[str, str], nproc: int | None = None) -> Rendezvous:
    """The rendezvous for this node, from a Slurm step's environment (``os.environ`` or a test dict).

    Master address: ``MASTER_ADDR`` when the batch script exported it (``scontrol show hostnames``),
    else the first host of the step's (or job's) node list. Port: ``MASTER_PORT`` or one derived from
    the job id. Raises ValueError when the variables disagree or the step runs several tasks per node.
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise ValueError("not inside a Slurm job (SLURM_JOB_ID / SLURM_JOB_NODELIST unset); "
                         "run torchrun directly, or use `srun python -m train.launch ...` inside sbatch")
    hosts = expand_nodelist(nodelist)
    declared = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if declared and int(declared) != len(hosts):
        raise ValueError(f"node list {nodelist!r} expands to {len(hosts)} hosts but Slurm says {declared} nodes")
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if tasks and max(_tasks_per_node(tasks)) > 1:
        raise ValueError(f"{tasks!r} tasks per node: train.launch expects ONE srun task per node (torchrun starts "
                         "the per-GPU workers); use `srun --ntasks-per-node=1` / `#SBATCH --ntasks-per-node=1`")
    me = env.get("SLURMD_NODENAME")
    if me in hosts:
        node_rank = hosts.index(me)
    elif "SLURM_NODEID" in env:
        node_rank = int(env["SLURM_NODEID"])
    else:
        raise ValueError("cannot tell this node's rank: neither SLURMD_NODENAME nor SLURM_NODEID is set")
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"node rank {node_rank} outside the {len(hosts)} nodes of {nodelist!r}")
    port = (int(env["MASTER_PORT"]) if env.get("MASTER_PORT")
            else PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % PORT_SPAN)
    return Rendezvous(
        nnodes=len(hosts), node_rank=node_rank, nproc_per_node=nproc_per_node(env, nproc),
        master_addr=env.get("MASTER_ADDR") or hosts[0], master_port=port, job_id=job_id,
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
    )


def worker_env(env: Mapping[str, str], nproc: int) -> dict[str, str]:
    """Environment this node's workers get on top of ``env``: OMP_NUM_THREADS = the task's CPUs
    (SLURM_CPUS_PER_TASK) shared by its ``nproc`` workers, at least 1, unless the user set it. Without it
    torchrun gives every worker 1 thread, too few for a GPU node's 8 CPUs per GPU; a fixed count
    oversubscribes a CPU node (the tiny recipe's 2 ranks on 2 CPUs). Outside Slurm: nothing (torchrun's 1)."""
    cpus = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if env.get("OMP_NUM_THREADS") or not cpus.isdigit():
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int(cpus) // nproc))}


def capture_slice_overrides(env: Mapping[str, str], num_slices: int) -> list[str]:
    """Hydra overrides for array task i of a capture split into ``num_slices`` slices.

    The slice index is SLURM_ARRAY_TASK_ID itself (arrays are 0-based: ``--array=0-(N-1)``), so re-running
    only the failed slices is ``sbatch --array=3,5 ...`` with the same script.
    """
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        raise ValueError("--capture-slices needs an array job (SLURM_ARRAY_TASK_ID unset); submit with --array")
    i = int(task)
    if not 0 <= i < num_slices:
        raise ValueError(f"SLURM_ARRAY_TASK_ID={i} outside 0..{num_slices - 1} for --capture-slices {num_slices}: "
                         f"submit with --array=0-{num_slices - 1} (or a subset of it)")
    return [f"capture.slice_index={i}", f"capture.num_slices={num_slices}"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fledge.pipeline.slurm.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (default: GPUs on node)")
    p.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "static"])
    p.add_argument("--capture-slices", type=int, default=None, metavar="N",
                   help="array-job capture: this task captures slice SLURM_ARRAY_TASK_ID of N")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("script", help="the entry point: a module (fledge.train.main, run as torchrun -m) or a .py file")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides passed to the script")
    return p.parse_args(argv)


def build_command(args: argparse.Namespace, env: Mapping[str, str], python: str = sys.executable) -> list[str]:
    """The torchrun command line this node should exec; outside Slurm, a one-node standalone run."""
    extra = capture_slice_overrides(env, args.capture_slices) if args.capture_slices else []
    if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
        rdzv_args = from_slurm_env(env, args.nproc_per_node).torchrun_args(args.rdzv_backend)
    else:
        rdzv_args = ["--standalone", f"--nproc_per_node={nproc_per_node(env, args.nproc_per_node)}"]
    entry = [args.script] if args.script.endswith(".py") else ["-m", args.script]
    return [python, "-m", "fledge.pipeline.torchrun", *rdzv_args, *entry, *args.overrides, *extra]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cmd = build_command(args, os.environ)
        extra_env = worker_env(os.environ, nproc_per_node(os.environ, args.nproc_per_node))
    except ValueError as e:
        print(f"fledge.launch: {e}", file=sys.stderr)
        sys.exit(2)
    shown = shlex.join([*(f"{k}={v}" for k, v in extra_env.items()), *cmd])
    if args.dry_run or os.environ.get("FLEDGE_LAUNCH_DRY_RUN") == "1":  # the env form is for sbatch tests
        print(shown, flush=True)
        return
    if os.environ.get("SLURM_NODEID", "0") == "0":
        print(f"fledge.launch: job {os.environ.get('SLURM_JOB_ID', '-')} "
              f"(restart {os.environ.get('SLURM_RESTART_COUNT', '0')}): {shown}", flush=True)
    os.environ.update(extra_env)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
