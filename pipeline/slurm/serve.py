"""The regenerate phase of a heterogeneous job: serve the target on the engine nodes, re-answer, stop it.

    python -m fledge.pipeline.slurm.serve --model M --engine-python P --pair IN:OUT [...] -- srun --het-group=1 ...

``fledge submit train|pipeline ... --engine-nodes N --regenerate IN:OUT`` puts this line in the batch script
(pipeline/slurm/train.sbatch, knob ``REGENERATE``), which runs it on component 0's first node before the trainer's
step. It starts vLLM's OpenAI server under the launcher words after ``--`` (an srun into component 1, pinned
here to that component's first node, listening on that node's NodeAddr only), waits (at most ``--wait-s``) for
``/health`` there,
runs ``fledge regenerate --endpoint http://ADDR:PORT/v1`` for every pair, and stops the server (SIGTERM to srun
ends the step; SIGKILL after a grace). A pair whose output already holds every input conversation (or lists it as
too long for the server's context, OUTPUT.too_long) is skipped, and when all are, the target is not served at all:
a requeued job goes straight to training. SIGTERM (the batch script's at the time limit), SIGINT or SIGHUP ends the
phase: `fledge regenerate` gets the signal and keeps its finished answers, the server is stopped, and the exit code
is 128 + the signal's.

The server's API key is ``FLEDGE_API_KEY`` from the environment, handed to vLLM as ``VLLM_API_KEY`` (srun
exports the environment); it is never on a command line nor printed. Without it the phase refuses to serve (an
open server on a shared cluster answers anyone who finds the port) unless ``--no-api-key`` says so.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from fledge import signals
from fledge.data.prepare.regenerate import API_KEY_ENV
from fledge.engine_process import engine_python, wait_healthy
from fledge.pipeline.slurm.launch import PORT_BASE, PORT_SPAN, expand_nodelist

ENGINE_GROUP = "1"  # the het job's engine component
STOP_GRACE_S = 30.0


def engine_node(env: Mapping[str, str]) -> str:
    """The first node of the engine component (SLURM_JOB_NODELIST_HET_GROUP_1)."""
    nodes = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{ENGINE_GROUP}")
    if not nodes:
        raise ValueError(f"not inside a heterogeneous job with an engine component (SLURM_JOB_NODELIST_HET_GROUP_"
                         f"{ENGINE_GROUP} unset): submit with `fledge submit ... --engine-nodes N`")
    return expand_nodelist(nodes)[0]


def node_addr(node: str, timeout: float = 30) -> str:
    """The address Slurm reaches ``node`` at (its NodeAddr); the node name when scontrol does not say."""
    try:
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True,
                             timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return node
    for word in out.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1] or node
    return node


def default_port(env: Mapping[str, str]) -> int:
    """A port from the job id, one above the trainers' rendezvous port (pipeline/slurm/launch.py)."""
    job = "".join(ch for ch in env.get("SLURM_JOB_ID", "0") if ch.isdigit()) or "0"
    return PORT_BASE + (int(job) + 1) % PORT_SPAN


def server_command(args: argparse.Namespace, node: str, addr: str, port: int) -> list[str]:
    """The launcher words (pinned to ``node``), then vLLM's OpenAI server on ``addr:port`` (the node's cluster
    address, not every interface)."""
    launcher = list(args.launcher)
    if launcher and Path(launcher[0]).name == "srun":
        launcher.insert(1, f"--nodelist={node}")
    cmd = [*launcher, str(engine_python(args.engine_python)), "-m", "vllm.entrypoints.openai.api_server",
           "--model", args.model, "--host", addr, "--port", str(port),
           "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.revision:
        cmd += ["--revision", args.revision]
    if args.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + shlex.split(args.server_args)


def pending(pair: tuple[str, str], extra: list[str]) -> int:
    """Input conversations of ``pair`` not yet in its output nor recorded too long for the server's context
    (what `fledge regenerate` would still do)."""
    from fledge.data.prepare.regenerate import finished_indices
    from fledge.data.prepare.sources import DataError, iter_rows, normalize

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--split", default="train")
    p.add_argument("--max-samples", type=int)
    known, _ = p.parse_known_args(extra)
    have, todo = finished_indices(pair[1]), 0
    for row in iter_rows(pair[0], known.split, known.max_samples):
        if row.error or row.index in have:
            continue
        try:  # a row regenerate skips as bad is not work left
            normalize(row.record, row.where)
        except DataError:
            continue
        todo += 1
    return todo


def stop(server: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to srun (which ends the step at once), SIGKILL after ``grace_s``."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=grace_s)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fledge.pipeline.slurm.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target, as vLLM loads it (and the name it serves)")
    p.add_argument("--engine-python", help="the python that has vLLM, on the engine nodes (default: "
                   "$FLEDGE_ENGINE_PYTHON, else .engine/venv)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--revision")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--server-args", default="", help="more words for vLLM's server, e.g. '--max-model-len 8192'")
    p.add_argument("--pair", action="append", required=True, metavar="INPUT:OUTPUT")
    p.add_argument("--regenerate-args", default="", help="more words for `fledge regenerate`, e.g. '--split x'")
    p.add_argument("--port", type=int, help="default: from the job id")
    p.add_argument("--wait-s", type=float, default=3600, help="longest wait for the server's /health")
    p.add_argument("--log", type=Path, required=True, help="the server's output (appended)")
    p.add_argument("--no-api-key", action="store_true", help=f"serve without a key when {API_KEY_ENV} is unset "
                   "(anyone who reaches the node's port can use the server)")
    p.add_argument("launcher", nargs=argparse.REMAINDER, help="after --: the command prefix the server runs under")
    args = p.parse_args(argv)
    args.launcher = args.launcher[1:] if args.launcher[:1] == ["--"] else args.launcher
    args.pairs = []
    for pair in args.pair:
        inp, sep, out = pair.rpartition(":")
        if not (sep and inp and out):
            p.error(f"--pair {pair!r}: expected INPUT:OUTPUT")
        args.pairs.append((inp, out))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    extra = shlex.split(args.regenerate_args)
    if "--api-key" in extra:
        print(f"fledge.serve: an API key on the command line is visible to every user; export {API_KEY_ENV}",
              file=sys.stderr)
        return 2
    todo = [pair for pair in args.pairs if pending(pair, extra)]
    for inp, out in sorted(set(args.pairs) - set(todo)):
        print(f"fledge.serve: {out} already holds every conversation of {inp}", flush=True)
    if not todo:
        print("fledge.serve: nothing to regenerate; the target is not served", flush=True)
        return 0
    env = dict(os.environ)
    if env.get(API_KEY_ENV):
        env["VLLM_API_KEY"] = env[API_KEY_ENV]
    elif args.no_api_key:
        print(f"fledge.serve: warning: serving without an API key (--no-api-key, {API_KEY_ENV} unset)",
              file=sys.stderr, flush=True)
    else:
        print(f"fledge.serve: {API_KEY_ENV} is not set in the job's environment, and a server without a key answers "
              f"anyone: export it in the shell that runs sbatch (`fledge submit ... | {API_KEY_ENV}=... bash`), or "
              "submit with --no-api-key", file=sys.stderr)
        return 2
    try:
        node = engine_node(os.environ)
    except ValueError as e:
        print(f"fledge.serve: {e}", file=sys.stderr)
        return 2
    addr, port = node_addr(node), args.port or default_port(os.environ)
    cmd = server_command(args, node, addr, port)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    print(f"fledge.serve: serving the target on {node} ({addr}:{port}), log {args.log}: {shlex.join(cmd)}",
          flush=True)
    server = regen = None
    rc = 0
    with signals.stop_on_signals():  # SIGTERM at the time limit (train.sbatch), Ctrl-C, SIGHUP: end it all, keep
        try:
            try:
                with signals.deferred(), open(args.log, "ab") as log:
                    server = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT)
                t0 = time.monotonic()
                wait_healthy(f"http://{addr}:{port}/health", server, args.wait_s, args.log)
                print(f"fledge.serve: server healthy after {time.monotonic() - t0:.0f} s", flush=True)
                for inp, out in todo:
                    words = [sys.executable, "-m", "fledge", "regenerate", "--input", inp, "--output", out,
                             "--endpoint", f"http://{addr}:{port}/v1", "--model", args.model, *extra]
                    print(f"fledge.serve: {shlex.join(words)}", flush=True)
                    with signals.deferred():
                        regen = subprocess.Popen(words)
                    rc = regen.wait() or rc
            except signals.Stopped as e:
                if regen is not None and regen.poll() is None:  # it keeps its finished answers and exits
                    regen.send_signal(e.signum)
                    try:
                        regen.wait(timeout=STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        regen.kill()
                        regen.wait()
                raise
            finally:
                if server is not None:
                    with signals.deferred():
                        stop(server)
        except RuntimeError as e:
            print(f"fledge.serve: {e}", file=sys.stderr)
            rc = 1
        except signals.Stopped as e:
            print(f"fledge.serve: stopped by {e.name}; the server is stopped and every finished answer kept: the "
                  "requeued (or resubmitted) job resumes the rest", file=sys.stderr)
            return e.exit_code
    if rc:
        print(f"fledge.serve: regeneration failed (exit {rc}); resubmit the same job to retry what is missing",
              file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
