"""Fledge entry point: ``torchrun --nproc_per_node=N train/main.py recipe=NAME [overrides]`` (or
``python -m fledge.train.main``, ``fledge run recipe=NAME``).

The path the product's brief fixes; the Hydra app it starts is the pipeline's (pipeline/app.py).
"""

from __future__ import annotations

import os
import sys

from fledge.pipeline.app import check_overrides, cli, main, run

__all__ = ["check_overrides", "cli", "main", "run"]

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check_overrides(sys.argv[1:])
    main()
