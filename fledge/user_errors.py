"""How a user's mistake reaches them: one line on stderr naming the file, line or key and the fix, and exit code 2.

Fledge raises ValueError (DataError is one) for bad input and config, with the file, line or key and the fix in
the message; the entry points (train/main.py, the ``fledge`` command's tools, pipeline/torchrun.py's ranks) turn those
into :func:`user_error`. Anything else is a bug and keeps its traceback. FLEDGE_DEBUG=1 (or Hydra's
HYDRA_FULL_ERROR=1) shows the traceback of user errors too.
"""

from __future__ import annotations

import os
import sys

USER_ERROR_EXIT_CODE = 2
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


def debugging() -> bool:
    return os.environ.get("FLEDGE_DEBUG") == "1" or os.environ.get("HYDRA_FULL_ERROR") == "1"


def user_error(e: BaseException | str, all_ranks_agree: bool = False) -> None:
    """Print ``e`` as one line and exit 2. Every rank that failed says so (a bad shard may fail one rank
    only), prefixed by its rank in a multi-process run; an error every rank raises alike (the config's)
    is printed once."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or not all_ranks_agree:
        where = f"[rank {rank}] " if world > 1 else ""
        print(f"fledge: {where}error: {e}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)
