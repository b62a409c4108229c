"""Fledge: train EAGLE-3.1 speculative-decoding drafters for a frozen target LLM and ship them to vLLM
and SGLang.

One namespace: ``fledge.conf`` (schema + composition), ``fledge.models`` and ``fledge.data`` (libraries),
``fledge.train`` (the train stage), ``fledge.evaluation`` (the eval stage), ``fledge.pipeline`` (stage records,
runner, preflight, publish, Slurm, the seeds driver), ``fledge.cli`` (the ``fledge`` command). Layers only point
down; the contracts are in pyproject.toml and checked in CI.
"""

__version__ = "0.1.0"
