"""Drafter layer kinds (an extension point): kind.py holds the record a kind fills in and the registry
``drafter.layer`` picks from; each kind's own file (llama.py, qwen3.py, mla.py) holds its attention and every
one of its special cases."""

from fledge.models.layers import llama, mla, qwen3  # noqa: F401  (importing a kind registers it)
