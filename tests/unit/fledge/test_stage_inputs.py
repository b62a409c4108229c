"""A stage is given its inputs (fledge/stage_inputs.py), and what the runner hashes is exactly their hashed
fields: each field is hashed under its config key or marked runtime, runtime parts of a section stay out, and
a config key moves the hash of exactly the stages whose inputs hold it (the recorded hashes of earlier Fledges:
tests/unit/pipeline/test_recorded_inputs.py)."""

from __future__ import annotations

import dataclasses

import pytest

from fledge import stage_inputs
from fledge.conf import compose
from fledge.pipeline.stages import STAGES, capture_inputs, train_inputs
from fledge.stage_inputs import hashed


def _cfg(*overrides):
    return compose(["recipe=tiny", *overrides])


def test_every_field_says_how_it_is_hashed_and_names_real_runtime_fields():
    """A field with no mark would be silently left out of the hash; a runtime name that is no field of its section
    (a typo, a renamed key) would hash what it meant to leave out."""
    cfg = _cfg()
    for name, stage in STAGES.items():
        inputs = stage.inputs(cfg)
        assert hashed(inputs), name
        for f in dataclasses.fields(inputs):
            meta = f.metadata
            assert "key" in meta or meta.get("runtime") is True, (name, f.name)
            value = getattr(inputs, f.name)
            names = meta.get("each") or meta.get("runtime") or ()
            if callable(names):
                names = names(value)
            if names and names is not True:
                assert set(names) <= {g.name for g in dataclasses.fields(value)}, (name, f.name)


def test_the_hash_holds_the_hashed_fields_without_their_runtime_parts():
    cfg = _cfg("train.max_steps=7", "capture.engine_timeout_s=5")
    train = hashed(train_inputs(cfg))
    assert {"drafter", "train", "deepspeed", "aux_layer_ids", "run.seed", "capture.mode", "target.revision"} <= set(
        train)
    assert not {"logging", "run.name", "recipe", "capture", "target"} & set(train)
    assert not set(stage_inputs.TRAIN_RUNTIME) & set(train["train"]) and train["train"]["optim"]["lr"] == 1e-3
    assert train["aux_layer_ids"] == cfg.aux_layer_ids() and train_inputs(cfg).train.max_steps == 7  # read, not hashed
    capture = hashed(capture_inputs(cfg))["capture"]
    assert "engine_timeout_s" not in capture and "tensor_parallel_size" not in capture  # engine=hf: vLLM's unread
    online = hashed(capture_inputs(_cfg("capture.mode=online")))["capture"]
    assert set(online) == set(stage_inputs.ONLINE_STATE_KEYS)


@pytest.mark.parametrize("key,value,stages", [
    ("eval.num_prompts", 3, {"eval"}),
    ("train.optim.lr", 1e-5, {"train"}),
    ("train.max_steps", 9, set()),  # cadence: Stage.done handles the length
    ("train.grad_accum", 4, set()),  # layout over ranks
    ("data.chat_template", "{{ x }}", {"prepare", "eval"}),
    ("target.config_overrides", {"rms_norm_eps": 1e-6}, {"export", "eval", "publish"}),
    ("target.revision", "abc", {"prepare", "capture", "train", "export", "eval", "publish"}),
    ("capture.chunk_tokens", 64, {"capture", "eval"}),
    ("capture.dtype", "fp8", {"capture", "train"}),
    ("capture.num_slices", 2, set()),
    ("data.num_proc", 4, set()),  # how many processes tokenize: prepare's output is the same (test_prepare.py)
    ("export.repo_id", "o/r", {"publish"}),
    ("export.format", "eagle3", {"export"}),
    ("logging.wandb_project", "p", set()),
    ("run.seed", 3, {"prepare", "train", "eval"}),
])
def test_a_key_changes_the_hash_of_exactly_the_stages_that_read_it(key, value, stages):
    base = _cfg()
    section, *path = key.split(".")
    changed = _cfg()
    obj = getattr(changed, section)
    for part in path[:-1]:
        obj = getattr(obj, part)
    setattr(obj, path[-1], value)
    assert dataclasses.asdict(changed) != dataclasses.asdict(base)
    moved = {name for name, stage in STAGES.items() if hashed(stage.inputs(base)) != hashed(stage.inputs(changed))}
    assert moved == stages
