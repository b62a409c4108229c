"""torchrun whose report of a failed rank is the rank's own: ``python -m fledge.pipeline.torchrun`` takes torchrun's
arguments (``--standalone --nproc_per_node=2 -m fledge.train.main recipe=tiny``) and runs torchrun's agent in this
process, as ``torchrun`` does, but when a rank fails it exits with that rank's exit code and at most one line.

A bare ``torchrun`` answers any failed rank with a ChildFailedError traceback and a failure box, after the rank's
own one-line error (fledge/user_errors.py). Here a rank that has said why in one line (a user error, exit
code 2; a preemption, 75; a stop signal, 128 + it) gets nothing added, and the agent's log line about its exit
code is dropped; any other failure (a bug, whose traceback the rank printed; a signal) gets one line naming the
rank and the code.
``fledge run --nproc-per-node N``, the Slurm launcher (pipeline/slurm/launch.py) and ``fledge compare --train`` start
their ranks through here.

SIGTERM, SIGINT and SIGHUP to this process go on to the ranks (each leads a session of its own, so a terminal's
Ctrl-C reaches none of them): they stop as a single process does (the trainer checkpoints and exits 75, another
stage exits 128 + the signal, rank 0 saying so in one line), and this process exits with their code. A second
signal kills the ranks. torch's own handling (its SignalException traceback, and SIGKILL 30 s after the ranks were
told) is left SIGQUIT. ``--standalone`` (one node) keeps its store on 127.0.0.1 (fledge/distributed.py
``loopback_store``): torch's listens on every interface, unauthenticated.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fledge.signals import STOP_SIGNALS, Stopped


def said_by_the_rank() -> tuple[int, ...]:
    """The exit codes with which a rank has printed its own one-line reason."""
    from fledge.train.trainer import PREEMPTED_EXIT_CODE
    from fledge.user_errors import USER_ERROR_EXIT_CODE

    return USER_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE, *(128 + s for s in STOP_SIGNALS)  # the last: app.py's Stopped


class _DropExitLines(logging.Filter):
    """Drops the agent's "failed (exitcode: C) local_rank: ..." line for the codes the rank explained, and its
    "Sending process P closing signal S" as it ends the other ranks after one failed (mechanics, not news)."""

    def __init__(self, codes: tuple[int, ...]):
        super().__init__()
        self.needles = (*(f"(exitcode: {c})" for c in codes), " closing signal ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun's agent with ``argv`` (torchrun's own arguments); the exit code of the run."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    codes = said_by_the_rank()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropExitLines(codes))
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.signals_to_handle = "SIGQUIT"  # the stop signals are this module's (_forward_to_ranks)
    store = _standalone_on_loopback(args) if args.standalone else None  # noqa: F841 - torch's agent shares it
    try:
        with _forward_to_ranks():
            run(args)
    except (Stopped, SignalException) as e:  # before any rank started, or SIGQUIT (torch's: it told the ranks)
        sig = e.signum if isinstance(e, Stopped) else int(e.sigval)
        print(f"fledge: stopped by {signal.Signals(sig).name}", file=sys.stderr, flush=True)
        return 128 + sig
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code in codes:
            return code
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            print(f"fledge: rank {rank} was killed by {name}", file=sys.stderr, flush=True)
            return 128 - code
        print(f"fledge: rank {rank} failed with exit code {code} (its output is above)", file=sys.stderr, flush=True)
        return code
    return 0


def _standalone_on_loopback(args):
    """``--standalone`` as one node's static rendezvous on a store of ours that listens on 127.0.0.1 only
    (torch's c10d rendezvous and the store it shares with the ranks listen on every interface): torch's agent,
    in this process, finds the store's server on its port and shares it (TCPStore's multi_tenant). Returns
    the store, which must live as long as the run."""
    import datetime

    from fledge.distributed import loopback_store

    store = loopback_store(datetime.timedelta(minutes=30), multi_tenant=True)
    args.standalone, args.rdzv_backend, args.rdzv_endpoint = False, "static", ""
    args.nnodes, args.node_rank, args.master_addr, args.master_port = "1", 0, "127.0.0.1", store.port
    return store


def _children() -> list[int]:
    """This process's children (the ranks, torch's agent starts them), from /proc."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@contextmanager
def _forward_to_ranks() -> Iterator[None]:
    """Within: the first stop signal goes on to every rank's process group (a rank leads its own), a second
    kills them (SIGKILL); this process goes on watching the ranks and exits with their code. One before any rank
    started raises :class:`Stopped` here."""
    got: list[int] = []

    def forward(signum, frame) -> None:
        got.append(signum)
        ranks = _children()
        if not ranks and len(got) == 1:
            raise Stopped(signum)
        for pid in ranks:
            try:
                group = os.getpgid(pid)
                if group == os.getpgrp():  # not a group of its own: the signal goes to it alone
                    os.kill(pid, signum if len(got) == 1 else signal.SIGKILL)
                else:
                    os.killpg(group, signum if len(got) == 1 else signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # exited meanwhile
                pass

    old = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
