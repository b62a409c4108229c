"""Fledge entry point: ``torchrun --nproc_per_node=N train/main.py recipe=NAME [overrides]``.

Hydra composes conf/ over the dataclass schema in train/config.py; this file turns the result into
typed objects once, sets up the process group, and runs the selected stages (train/stages.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from train.config import Config

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
ConfigStore.instance().store(name="fledge_schema", node=Config)
log = logging.getLogger("fledge")


def to_config(dcfg: DictConfig) -> Config:
    """DictConfig (already type-checked by the schema) -> validated Config dataclasses."""
    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, Config)
    return cfg.validate()


def run(cfg: Config) -> dict:
    from data.atomic import write_bytes_atomic
    from train.distributed import destroy_world, init_world, setup_logging
    from train.stages import run_stages

    world = init_world()
    setup_logging(world)
    run_dir = Path(cfg.run.output_root) / cfg.run.name
    if world.is_main:
        write_bytes_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())
        log.info("recipe %s, run directory %s, world %d on %s", cfg.recipe, run_dir, world.world_size, world.device)
    try:
        manifests = run_stages(cfg, world)
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
    except ValueError as e:
        print(f"fledge: config error: {e}", file=sys.stderr)
        sys.exit(2)
    from train.trainer import PREEMPTED_EXIT_CODE, Preempted

    try:
        run(cfg)
    except NotImplementedError as e:
        print(f"fledge: {e}", file=sys.stderr)
        sys.exit(3)
    except Preempted as e:
        print(f"fledge: {e}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
