"""Fledge's configuration: the typed schema (``schema.py``), the one function that composes ``conf/`` over
it (``compose.py``), and the YAML groups beside them (shipped as package data)."""

from fledge.conf.compose import CONF_DIR, compose, to_config
from fledge.conf.schema import Config

__all__ = ["CONF_DIR", "Config", "compose", "to_config"]
