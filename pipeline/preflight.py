"""What every entry point checks before any work: the config keys that name registry entries, and the rules
that depend on more than the schema can see.

The schema (conf/schema.py) types and cross-checks the config but cannot import the registries, which live
with the code they extend (fledge/registry.py; docs/extending.md). :data:`CONFIG_REGISTRIES` is the one
table of config key -> registry; :func:`check_config` runs it and the rules across registries. `fledge run`
(train/main.py), `fledge config` (fledge/cli.py) and `fledge submit` (pipeline/slurm/submit.py) all call it, so
a config one of them refuses, every one refuses. :func:`check_environment` adds what depends on where the
command runs (the world size, the Hub token), for `fledge run` only; :func:`check_target_path` runs with the
runner, before any stage.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

from fledge.conf import compose
from fledge.conf.schema import Config, ExportConfig
from fledge.distributed import check_sequence_parallel
from fledge.evaluation.eval_sets import EVAL_SETS, check_reachable, check_set_names
from fledge.models.layers.kind import LAYER_KINDS, check_layer_format
from fledge.registry import Registry
from fledge.serving.dialects import DIALECTS, check_export_format
from fledge.testbed.hints import build_hint
from fledge.train.losses import LOSSES, check_loss_config

# Config key -> the registry its value (or each value of a list) must name. Target families are keyed by the
# target's own model_type, read from its config.json when a stage loads it (models/families.py).
CONFIG_REGISTRIES: dict[str, Registry] = {
    "drafter.loss": LOSSES,
    "drafter.layer": LAYER_KINDS,
    "export.format": DIALECTS,
    "eval.sets": EVAL_SETS,
}


def config_value(cfg: Config, key: str):
    """The value at a dotted config key ("drafter.loss")."""
    return functools.reduce(getattr, key.split("."), cfg)


def check_config(cfg: Config) -> None:
    """ValueError naming the key when a registry key names nothing registered, or when entries of two
    registries (or an entry and the config) cannot go together."""
    for key, registry in CONFIG_REGISTRIES.items():
        value = config_value(cfg, key)
        for name in value if isinstance(value, (list, tuple)) else [value]:
            registry.check(name)
    check_export_format(cfg.export.format, cfg.aux_layer_ids(), cfg.target.num_hidden_layers)
    check_layer_format(cfg.drafter.layer, cfg.export.format)
    check_set_names(cfg.eval.sets, cfg.eval.set_paths if "eval" in cfg.run.stages else {})
    check_loss_config(cfg.drafter)  # drafter.loss=mix: every name in drafter.loss_mix registered


def compose_checked(overrides: list[str]) -> Config:
    """The Config ``fledge run`` would run with these overrides, refused exactly as it refuses it."""
    cfg = compose(overrides)
    check_config(cfg)
    return cfg


def check_environment(cfg: Config, world_size: int) -> None:
    """What depends on where this command runs: the world must split into the sequence-parallel groups
    (before any stage, not after hours of capture), a named eval set must be readable here (not after the
    training), and a run that will publish needs its token now."""
    if "train" in cfg.run.stages:
        check_sequence_parallel(world_size, cfg.train.sequence_parallel)
    if "eval" in cfg.run.stages:
        check_reachable(cfg.eval.sets, cfg.eval.set_paths)
    check_publish(cfg.export, cfg.run.stages)


def check_publish(export: ExportConfig, stages: Sequence[str]) -> None:
    """A run that will publish (``export.push_to_hub`` and the publish stage among ``stages``) needs a token in
    HF_TOKEN and the Hub reachable."""
    if not (export.push_to_hub and "publish" in stages):
        return
    import huggingface_hub.constants  # only when publishing: the Hub client is not needed otherwise

    if not os.environ.get("HF_TOKEN"):
        raise ValueError("export.push_to_hub=true: the publish stage reads the Hub token from HF_TOKEN only, and "
                         "it is not set; export HF_TOKEN (a write token), or set export.push_to_hub=false")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError("export.push_to_hub=true with HF_HUB_OFFLINE=1: publishing needs the Hub; unset "
                         "HF_HUB_OFFLINE for this command, or set export.push_to_hub=false")


def check_target_path(name_or_path: str) -> None:
    """A target written as a path (absolute, or starting with . or ~) must exist before any stage runs;
    otherwise transformers reads it as a malformed hub id and fails deep inside a stage. A testbed target
    names the command that builds it."""
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().is_dir():
        hint = build_hint(name_or_path)
        raise ValueError(f"target.name_or_path={name_or_path}: no such directory{f' ({hint})' if hint else ''}; "
                         "give a model directory or a hub id (org/name)")
