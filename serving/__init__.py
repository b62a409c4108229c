"""The serving format: export dialects and their config.json, the export itself, the linter, the aux ids
each engine reads, the Hub push and model card, and running an engine on an export (serving/engine.py, with
the driver that runs under the engine's own python in vllm_side/: package data, never imported by Fledge)."""
