"""A private Slurm cluster on this machine: munged, slurmctld and two slurmd, for tests/slurm/ (the
``slurm_cluster`` fixture of tests/conftest.py starts one per module; ``slurm_marks`` is those modules' pytestmark).

``LocalSlurm(root).start()`` writes a munge key, ``slurm.conf`` and every daemon's state, spool, pid and log
file under ``root``, starts the daemons on free localhost ports and waits until both nodes are idle;
``stop()`` cancels every job, stops the daemons and ends any process a job left behind. Nothing outside
``root`` is written or left running: clients find the cluster through ``env`` (``SLURM_CONF``), and the
packages' own services (scripts/setup_slurm.sh installs the programs only) are never started.

Layout: one partition, ``cpu``, of two nodes ``n1`` and ``n2``. Both are this machine (``slurmd -N NAME``
with its own port, NodeAddr 127.0.0.1) and each offers all its CPUs, so a ``--nodes 2`` job gets two
nodes and its ranks meet through ``SLURM_JOB_NODELIST`` as on a real cluster, while the cores are shared.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo", "srun")
SBIN = "/usr/sbin:/sbin"  # slurmctld, slurmd and munged live there; a non-root PATH may lack it
NODES = ("n1", "n2")
PARTITION = "cpu"
# Slurm keeps a finished job's record this long (scontrol show job is how the tests read a job's end)
MIN_JOB_AGE_S = 3600
# Slurm's own grace between SIGTERM and SIGKILL when it ends a job (requeue, scancel, preemption)
KILL_WAIT_S = 30


def missing_programs() -> list[str]:
    """The Slurm and munge programs this machine lacks (scripts/setup_slurm.sh installs them)."""
    path = f"{os.environ.get('PATH', '')}:{SBIN}"
    return [name for name in PROGRAMS if shutil.which(name, path=path) is None]


def slurm_marks() -> list:
    """pytestmark of a module that submits real Slurm jobs (the ``slurm_cluster`` fixture): marked ``slurm`` (run
    them alone with ``-m slurm``) and ``slow``; skipped where Slurm is not installed on a developer's machine; a
    missing Slurm fails collection under CI=true or FLEDGE_SLURM=1, unless FLEDGE_SLURM_OPTIONAL=1 marks a CI
    that cannot install it (scripts/setup_slurm.sh)."""
    missing = missing_programs()
    reason = f"Slurm is not installed (missing {', '.join(missing)}: bash scripts/setup_slurm.sh)"
    required = os.environ.get("FLEDGE_SLURM") == "1" or (
        os.environ.get("CI") == "true" and os.environ.get("FLEDGE_SLURM_OPTIONAL") != "1")
    if missing and required:
        pytest.fail(f"{reason}; CI (or FLEDGE_SLURM=1) requires it (FLEDGE_SLURM_OPTIONAL=1 for a CI without "
                    "root or apt-get)", pytrace=False)
    return [pytest.mark.skipif(bool(missing), reason=reason), pytest.mark.slurm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """The cluster under ``root`` (a fresh directory); see the module docstring."""

    def __init__(self, root: Path, cpus: int | None = None) -> None:
        self.root = Path(root)
        self.daemons: list[subprocess.Popen] = []  # in start order; stopped in reverse
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        # what clients (and, through sbatch's --export=ALL, the jobs) need to find this cluster
        self.env = {**base, "SLURM_CONF": str(self.conf), "PATH": f"{base.get('PATH', '')}:{SBIN}"}

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> LocalSlurm:
        """Write the config, start munged, slurmctld and one slurmd per node; return once both nodes are idle."""
        missing = missing_programs()
        if missing:
            raise RuntimeError(f"Slurm programs missing: {missing} (bash scripts/setup_slurm.sh)")
        self._write_config()
        try:
            self._start_munge()
            self._daemon(["slurmctld", "-D"], "slurmctld.log")
            self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), 30, "slurmctld to answer")
            for node in NODES:
                self._daemon(["slurmd", "-D", "-N", node], f"slurmd-{node}.log")
            self._wait(lambda: self.node_states() == {n: "idle" for n in NODES}, 60, "both nodes to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), then end whatever a job left running."""
        if len(self.daemons) == 2 + len(NODES):  # the whole cluster came up: let Slurm end its jobs
            try:
                self.run("scancel", "--partition", PARTITION, check=False)
                self._wait(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).strip(),
                           KILL_WAIT_S + 15, "the jobs to end")
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                pass  # a daemon died or hangs: they go anyway, and what the jobs left is killed below
        while self.daemons:
            _stop(self.daemons.pop())
        for pid in self.leftovers():
            _kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """Processes still running with this cluster's SLURM_CONF in their environment (job steps, their
        children, slurmstepd): everything a job started inherits it from sbatch's --export=ALL."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for env_file in Path("/proc").glob("[0-9]*/environ"):
            pid = int(env_file.parent.name)
            if pid == os.getpid():
                continue
            try:
                if mark in env_file.read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:  # gone, or not ours to read
                continue
        return found

    # ---- clients ---------------------------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        """Run a client command (sbatch, scontrol, ...) against this cluster; its stdout."""
        res = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}\n{res.stdout}{res.stderr}")
        return res.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    @staticmethod
    def steps_alive(job_id: str) -> list[str]:
        """The slurmstepd processes of ``job_id`` still on this machine (every node is this machine): the
        titles slurmstepd gives itself, ``slurmstepd: [JOB.batch]``, ``[JOB.0]``, ... A job's batch shell and
        its step's tasks are their children, so none is left once these are gone."""
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                title = cmdline.read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:  # the process ended while we looked
                continue
            if title.startswith(f"slurmstepd: [{job_id}."):
                alive.append(title)
        return alive

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job`` as dicts, one per job (an array job: one per task)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return [_fields(line) for line in out.splitlines() if line.strip()]

    def state(self, job_id: str) -> set[str]:
        """The JobState of every task of ``job_id``."""
        return {j["JobState"] for j in self.jobs(job_id)}

    def wait_done(self, job_ids: list[str], timeout: float) -> dict[str, set[str]]:
        """Wait until no task of ``job_ids`` is pending, running or completing; their end states."""
        active = {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"}
        try:
            self._wait(lambda: not any(self.state(j) & active for j in job_ids), timeout, f"jobs {job_ids} to end")
        except TimeoutError as e:
            jobs = "\n".join(self.run("scontrol", "-o", "show", "job", j, check=False) for j in job_ids)
            raise TimeoutError(f"{e}\n--- the jobs\n{jobs}") from None
        return {j: self.state(j) for j in job_ids}

    # ---- internals -------------------------------------------------------------------------------------

    def _write_config(self) -> None:
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its socket directory reachable by everyone and its key private
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.root / "plugstack.conf").write_text("")  # not the system's /etc/slurm/plugstack.conf
        user = _user()
        ctld_port, *node_ports = (_free_port() for _ in range(1 + len(NODES)))
        r = self.root
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
                          "State=UNKNOWN" for n, p in zip(NODES, node_ports))
        self.conf.write_text(f"""\
# Written by tests/helpers/slurm_cluster.py: a private cluster of this machine, gone when the tests end.
ClusterName=fledge-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
PlugStackConfig={r}/plugstack.conf
# no cgroups: the job's processes are tracked by parent pid, and not bound to cores
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# heterogeneous jobs are started by the backfill scheduler alone: every second, not every 30 s
SchedulerParameters=bf_interval=1
# the two slurmd report the same machine; take the CPUs written here
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge={MIN_JOB_AGE_S}
KillWait={KILL_WAIT_S}
# a failed upstream job cancels the jobs waiting on it instead of leaving them pending for ever
DependencyParameters=kill_invalid_depend
{nodes}
PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munge(self) -> None:
        m = self.root / "munge"
        self._daemon(["munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={m / 'munge.key'}",
                      f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                      f"--seed-file={m / 'munged.seed'}"], "munge/munged.log")
        self._wait(lambda: self.munge_socket.exists(), 15, "munged's socket")

    def _daemon(self, cmd: list[str], log: str) -> None:
        """Start a daemon in the foreground, as our child (so stop() can wait for it and nothing is orphaned);
        its own log file is ``root/log``, its stderr goes next to it."""
        with open(self.root / f"{Path(log).name}.stderr", "w") as err:
            proc = subprocess.Popen([_which(cmd[0]), *cmd[1:]], env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=err, stderr=subprocess.STDOUT)
        self.daemons.append(proc)
        time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{_tail(self.root / log)}\n"
                               f"{_tail(self.root / f'{Path(log).name}.stderr')}")

    def _ok(self, cmd: list[str], expect: str) -> bool:
        return expect in self.run(*cmd, check=False, timeout=15)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}\n{self._logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}\n{self._logs()}")
            time.sleep(0.5)

    def _logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{_tail(p, 1500)}" for p in sorted(self.root.rglob("*.log*")))


def _fields(line: str) -> dict[str, str]:
    """``Key=value Key2=value2 ...`` (scontrol -o); values with spaces are only in keys the tests ignore."""
    out = {}
    for item in line.split():
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _which(name: str) -> str:
    found = shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if found is None:
        raise RuntimeError(f"{name} not found (bash scripts/setup_slurm.sh)")
    return found


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(none)"


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM a daemon, SIGKILL it after ``grace`` seconds; reap it either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
