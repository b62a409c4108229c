"""The pipeline's Hydra app, started by train/main.py (``torchrun --nproc_per_node=N train/main.py
recipe=NAME [overrides]``, ``python -m fledge.train.main``) and by ``fledge run recipe=NAME``.

Hydra composes conf/ over the dataclass schema (fledge.conf); this file turns the result into typed
objects once, sets up the process group, and runs the selected stages (pipeline/stages.py).
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from fledge.conf import CONF_DIR, Config, to_config
from fledge.user_errors import USER_ERRORS, debugging, user_error

log = logging.getLogger("fledge")


def run(cfg: Config) -> dict:
    """Set up the process group and run the pipeline's selected stages (pipeline/stages.py); returns the
    manifests of the stages that are complete and current."""
    # The pipeline (torch, DeepSpeed, transformers) is imported only once the overrides have composed
    # (check_overrides): a mistyped key is one line in a second, not after the heavy imports.
    from fledge.progress import quiet_library_bars

    quiet_library_bars()  # before the imports below bring in datasets and transformers
    from fledge.atomic import write_bytes_atomic
    from fledge.distributed import destroy_world, init_world, setup_logging
    from fledge.pipeline.runner import run_stages
    from fledge.pipeline.stages import PIPELINE
    from fledge.run_layout import RunLayout

    layout = RunLayout.of(cfg.run)
    _check_config_is_fledges(layout.config)  # on every rank, before any process group: each refuses alike
    world = init_world()
    setup_logging(world)
    if world.is_main:
        write_bytes_atomic(layout.config, OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())
        log.info("recipe %s, run directory %s, world %d on %s", cfg.recipe, layout.root, world.world_size,
                 world.device)
    try:
        manifests = run_stages(cfg, world, PIPELINE)
    finally:
        destroy_world()
    if world.is_main:
        for stage, m in manifests.items():
            summary = ", ".join(f"{k}={v}" for k, v in (m.get("outputs") or {}).items()
                                if not isinstance(v, (dict, list)))
            log.info("%-8s [%s] %s", stage, ACTIONS.get(m.get("action"), m.get("action")), summary or "done")
    return manifests


def _check_config_is_fledges(path) -> None:
    """The run directory's config.yaml is absent or one a Fledge run wrote (a composed config: run and recipe at
    its top): the run writes over it, and a file of someone else's there is refused in one line."""
    if not path.is_file():
        return
    try:
        text = OmegaConf.load(path)
        ours = isinstance(text, DictConfig) and {"run", "recipe"} <= set(text.keys())
    except Exception:  # noqa: BLE001 - any file that does not parse as a config is not a run's
        ours = False
    if not ours:
        raise ValueError(f"{path} exists and is not a Fledge run's config (a run writes its config there): "
                         f"pick another run.name or run.output_root, or move that file away (nothing was written)")


# What this command did with each stage (pipeline/runner.py's plan), as the closing summary says it.
ACTIONS = {"use": "kept, not selected", "skip": "up to date", "run": "ran", "resume": "ran on from its own output",
           "start over": "started over"}


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(dcfg: DictConfig) -> None:
    # imported after Hydra composed the config, for the reason given in run()
    from fledge.pipeline.preflight import check_config, check_environment
    from fledge.pipeline.runner import Refused
    from fledge.signals import Stopped, stop_on_signals
    from fledge.train.trainer import PREEMPTED_EXIT_CODE, Preempted

    try:
        cfg = to_config(dcfg)
        check_config(cfg)  # the registries' keys and the rules across them (also `fledge config`, `fledge submit`)
        check_environment(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # world size, Hub token: before any stage
    except ValueError as e:
        if debugging():
            raise
        user_error(f"config: {e}", all_ranks_agree=True)
    said = int(os.environ.get("RANK", "0")) == 0  # every rank stops alike: rank 0 says so, once
    try:
        with stop_on_signals():  # SIGTERM, SIGINT, SIGHUP: every `finally` runs, ending the engines it started
            run(cfg)
    except Preempted as e:  # the trainer's stop, at a step boundary, after its checkpoint
        if said:
            print(f"fledge: {e}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)
    except Stopped as e:
        if said:
            print(f"fledge: stopped by {e.name}; the stages done are kept: re-run the same command to go on",
                  file=sys.stderr)
        sys.exit(e.exit_code)
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
    """``fledge run [--nproc-per-node N] [overrides]``: Hydra reads its overrides from sys.argv; with N, torchrun's
    agent in this process starts N ranks of this module (pipeline/torchrun.py: a rank's one-line error stays one)."""
    nproc, argv = nproc_per_node(argv)
    check_overrides(argv)
    if nproc:
        from fledge.pipeline.torchrun import main as torchrun

        return torchrun(["--standalone", f"--nproc_per_node={nproc}", "-m", "fledge.train.main", *argv])
    sys.argv = ["fledge run", *argv]
    main()
    return 0


def nproc_per_node(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--nproc-per-node N`` (or ``=N``) taken out of ``argv``; a bad N is one line and exit code 2."""
    rest, nproc, it = [], None, iter(argv)
    for a in it:
        if a == "--nproc-per-node" or a.startswith("--nproc-per-node="):
            value = a.partition("=")[2] if "=" in a else next(it, "")
            if not value.isdigit() or int(value) < 1:
                user_error(f"--nproc-per-node {value!r}: a count of ranks >= 1, e.g. --nproc-per-node 2")
            nproc = int(value)
        else:
            rest.append(a)
    return nproc, rest

