"""Capture of the target's states: into the feature store in process with transformers (offline.py) or through vLLM
(engine.py, with the driver and connector that run under the engine's own python in vllm_side/: package data, never
imported by Fledge), or live for the trainer (online.py: the target beside the drafter; stream.py: a vLLM engine's
stream). sources.py chooses which of these the trainer reads."""
