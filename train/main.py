"""Fledge entry point: ``torchrun --nproc_per_node=N train/main.py recipe=NAME [overrides]`` (or
``fledge run recipe=NAME``).

Hydra composes conf/ over the dataclass schema (fledge.conf); this file turns the result into typed
objects once, sets up the process group, and runs the selected stages (train/stages.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from fledge.conf import CONF_DIR, Config, to_config

log = logging.getLogger("fledge")


def run(cfg: Config) -> dict:
    from fledge.atomic import write_bytes_atomic
    from fledge.distributed import destroy_world, init_world, setup_logging
    from fledge.train.runner import run_stages
    from fledge.train.stages import STAGES

    world = init_world()
    setup_logging(world)
    run_dir = Path(cfg.run.output_root) / cfg.run.name
    if world.is_main:
        write_bytes_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())
        log.info("recipe %s, run directory %s, world %d on %s", cfg.recipe, run_dir, world.world_size, world.device)
    try:
        manifests = run_stages(cfg, world, STAGES)
    finally:
        destroy_world()
    if world.is_main:
        for stage, m in manifests.items():
            summary = ", ".join(f"{k}={v}" for k, v in (m.get("outputs") or {}).items() if not isinstance(v, (dict, list)))
            log.info("%-8s [%s] %s", stage, ACTIONS.get(m.get("action"), m.get("action")), summary or "done")
    return manifests


# What this command did with each stage (train/runner.py's plan), as the closing summary says it.
ACTIONS = {"use": "kept, not selected", "skip": "up to date", "run": "ran", "resume": "ran on from its own output",
           "start over": "started over"}


# Fledge raises ValueError (DataError is one) for bad input and config, with the file, line or key and the
# fix in the message; those reach the user as one line and exit code 2. Anything else is a bug and keeps its
# traceback. FLEDGE_DEBUG=1 (or Hydra's HYDRA_FULL_ERROR=1) shows the traceback of user errors too.
USER_ERROR_EXIT_CODE = 2
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


def debugging() -> bool:
    return os.environ.get("FLEDGE_DEBUG") == "1" or os.environ.get("HYDRA_FULL_ERROR") == "1"


def user_error(e: BaseException, all_ranks_agree: bool = False) -> None:
    """Print ``e`` as one line and exit 2. Every rank that failed says so (a bad shard may fail one rank
    only), prefixed by its rank in a multi-process run; an error every rank raises alike (the config's)
    is printed once."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or not all_ranks_agree:
        where = f"[rank {rank}] " if world > 1 else ""
        print(f"fledge: {where}error: {e}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT_CODE)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(dcfg: DictConfig) -> None:
    from fledge.data.eval_sets import check_set_names
    from fledge.distributed import check_sequence_parallel
    from fledge.models.dialects import check_export_format
    from fledge.models.layers import check_layer_format
    from fledge.train.loss import check_loss_config
    from fledge.train.runner import Refused
    from fledge.train.stages import check_publish
    from fledge.train.trainer import PREEMPTED_EXIT_CODE, Preempted

    try:
        cfg = to_config(dcfg)
        # The registries live above conf (the schema cannot import them): check their keys here, before any stage.
        check_loss_config(cfg.drafter)
        check_export_format(cfg.export.format, cfg.aux_layer_ids(), cfg.target.num_hidden_layers)
        check_set_names(cfg.eval.sets, cfg.eval.set_paths if "eval" in cfg.run.stages else {})
        check_layer_format(cfg.drafter.layer, cfg.export.format)
        if "train" in cfg.run.stages:  # before any stage runs, not after hours of capture
            check_sequence_parallel(int(os.environ.get("WORLD_SIZE", "1")), cfg.train.sequence_parallel)
        check_publish(cfg)  # a missing token stops the command now, not after training
    except ValueError as e:
        if debugging():
            raise
        user_error(f"config: {e}", all_ranks_agree=True)
    try:
        run(cfg)
    except Preempted as e:
        print(f"fledge: {e}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)
    except USER_ERRORS as e:
        if debugging():
            raise
        user_error(e, all_ranks_agree=isinstance(e, Refused))


def check_overrides(argv: list[str]) -> None:
    """Compose the command line's overrides once before Hydra does, so a bad key, type or group is one
    line naming it and exit code 2 (Hydra's own report is a traceback hint and exit code 1). Hydra's flags
    (--cfg, --help, -m, ...) are left to Hydra."""
    if debugging() or any(a.startswith("-") for a in argv):
        return
    from fledge.conf import compose

    try:
        compose(argv)
    except ValueError as e:
        user_error(f"config: {e}", all_ranks_agree=True)


def cli(argv: list[str]) -> int:
    """``fledge run [overrides]``: Hydra reads its overrides from sys.argv."""
    sys.argv = ["fledge run", *argv]
    check_overrides(argv)
    main()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check_overrides(sys.argv[1:])
    main()
