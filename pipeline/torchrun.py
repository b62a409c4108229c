"""torchrun whose report of a failed rank is the rank's own: ``python -m fledge.pipeline.torchrun`` takes torchrun's
arguments (``--standalone --nproc_per_node=2 -m fledge.train.main recipe=tiny``) and runs torchrun's agent in this
process, as ``torchrun`` does, but when a rank fails it exits with that rank's exit code and at most one line.

A bare ``torchrun`` answers any failed rank with a ChildFailedError traceback and a failure box, after the rank's
own one-line error (fledge/user_errors.py). Here a rank that has said why in one line (a user error, exit
code 2; a preemption, 75) gets nothing added, and the agent's log line about its exit code is dropped; any other
failure (a bug, whose traceback the rank printed; a signal) gets one line naming the rank and the code.
``fledge run --nproc-per-node N``, the Slurm launcher (pipeline/slurm/launch.py) and ``fledge compare --train`` start
their ranks through here.
"""

from __future__ import annotations

import logging
import signal
import sys


def said_by_the_rank() -> tuple[int, ...]:
    """The exit codes with which a rank has printed its own one-line reason."""
    from fledge.train.trainer import PREEMPTED_EXIT_CODE
    from fledge.user_errors import USER_ERROR_EXIT_CODE

    return USER_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE


class _DropExitLines(logging.Filter):
    """Drops the agent's "failed (exitcode: C) local_rank: ..." line for the codes the rank explained."""

    def __init__(self, codes: tuple[int, ...]):
        super().__init__()
        self.needles = tuple(f"(exitcode: {c})" for c in codes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun's agent with ``argv`` (torchrun's own arguments); the exit code of the run."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    codes = said_by_the_rank()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropExitLines(codes))
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
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


if __name__ == "__main__":
    sys.exit(main())
