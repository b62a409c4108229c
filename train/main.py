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
            log.info("%-8s %s", stage, summary or "done")
    return manifests


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = to_config(dcfg)
        from fledge.models.dialects import get_dialect

        get_dialect(cfg.export.format)  # the dialect registry lives in models, above conf's own checks
    except ValueError as e:
        print(f"fledge: config error: {e}", file=sys.stderr)
        sys.exit(2)
    from fledge.train.trainer import PREEMPTED_EXIT_CODE, Preempted

    try:
        run(cfg)
    except Preempted as e:
        print(f"fledge: {e}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)


def cli(argv: list[str]) -> int:
    """``fledge run [overrides]``: Hydra reads its overrides from sys.argv."""
    sys.argv = ["fledge run", *argv]
    main()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
