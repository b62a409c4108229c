"""Capture of the target's states into the feature store: in process with transformers (offline.py, and the
online source the trainer reads live), or through vLLM (engine.py, with the driver and connector that run
under the engine's own python in vllm_side/: package data, never imported by Fledge)."""
