"""The one place that turns ``conf/`` plus overrides into a validated :class:`Config`.

``train/main.py`` (the Hydra app) and every tool (lint, submit, benchmarks, tests) compose through here,
so a recipe means the same thing everywhere. The YAML groups live beside this file and ship in the wheel.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from fledge.conf.schema import Config

CONF_DIR = str(Path(__file__).resolve().parent)
ConfigStore.instance().store(name="fledge_schema", node=Config)


def unknown_keys(node: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys of ``node`` its schema does not have: what a ``+key=value`` override adds past the schema (Hydra
    lets ``+`` add a key even to a structured config). Free-form maps (``eval.set_paths``) take any key."""
    import dataclasses

    out = []
    for key in node:
        name = f"{prefix}{key}"
        if key not in schema.keys():  # not `in schema`: that is False for a ??? (missing) value too
            out.append(name)
            continue
        child, ref = node._get_node(key), schema._get_node(key)
        if isinstance(child, DictConfig) and isinstance(ref, DictConfig) and \
                dataclasses.is_dataclass(OmegaConf.get_type(ref)):
            out += unknown_keys(child, ref, f"{name}.")
    return out


def to_config(dcfg: DictConfig) -> Config:
    """DictConfig (already type-checked by the schema) -> validated Config dataclasses."""
    extra = unknown_keys(dcfg, OmegaConf.structured(Config))
    if extra:
        raise ValueError(f"{', '.join(extra)}: no such config key (a + override adds a key the schema does not "
                         "have); fledge config recipe=NAME prints every key")
    try:
        cfg = OmegaConf.to_object(dcfg)
    except MissingMandatoryValue as e:  # a ??? left unset: the schema's mandatory keys, or a list entry's
        key = re.sub(r"\[(\d+)\]", r".\1", str(e.full_key))  # data.sources[0].path -> data.sources.0.path
        raise ValueError(f"{key} has no value (??? in the schema): set it in the recipe or on the command line, "
                         f"e.g. {key}=VALUE") from None
    assert isinstance(cfg, Config)
    return cfg.validate()


def compose(overrides: list[str] | None = None) -> Config:
    """The validated Config that ``train/main.py`` would build from these command-line overrides
    (``["recipe=llama3", "train.optim.lr=5e-5"]``). A bad key, type or value raises ValueError naming it."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            dcfg = hydra_compose(config_name="config", overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"overrides {list(overrides or [])}: {hydra_message(e)}") from None
    finally:
        GlobalHydra.instance().clear()
    return to_config(dcfg)


def hydra_message(e: BaseException) -> str:
    """Hydra's report as one line: a group's options listed inline, its config search path left out, the
    reason a merge failed (a wrong type, an unknown key), which Hydra keeps in the exception's cause, and not
    its hint to append an unknown key with +, which the schema refuses too."""
    text = str(e).split("\nConfig search path:")[0]
    text, _, options = text.partition("\n\nAvailable options in ")
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("To append to your config")]
    if e.__cause__ is not None and str(e.__cause__).strip():
        lines[0] = f"{lines[0].rstrip('.')}: {str(e.__cause__).strip().splitlines()[0]}"
    if options:
        group, _, names = options.partition(":")
        lines.append(f"the options in {group}: {', '.join(names.split())}")
    return "; ".join(lines)
