"""Fledge: train EAGLE-3.1 speculative-decoding drafters for a frozen target LLM and ship them to vLLM
and SGLang.

One namespace: ``fledge.conf`` (schema + composition), ``fledge.models`` and ``fledge.data`` (libraries),
``fledge.train`` (the pipeline), ``fledge.cli`` (the ``fledge`` command). Layers only point down; the
contracts are in pyproject.toml and checked in CI.
"""

__version__ = "0.1.0"
