"""A stage reads the config only through its slice (fledge/stage_context.py), and what the runner hashes is
exactly the slice's hashed keys: a read outside the record fails at once, naming the key and where to
declare it; every record's slice is what its stage reads (the suite's pipeline runs go through the runner,
so an undeclared read anywhere in a stage's work fails them)."""

from __future__ import annotations

import pytest

from fledge.conf import compose
from fledge.pipeline.stages import STAGES
from fledge.stage_context import ConfigSlice, Reads, UndeclaredRead


def _cfg(*overrides):
    return compose(["recipe=tiny", *overrides])


def test_a_read_outside_the_slice_names_the_key_and_the_record():
    cfg = _cfg()
    job = ConfigSlice(cfg, Reads(("eval", "drafter.ttt_steps"), ("run.name",)), "eval")
    assert job.eval is cfg.eval and job.drafter.ttt_steps == cfg.drafter.ttt_steps and job.run.name == cfg.run.name
    for read in (lambda: job.train, lambda: job.drafter.hidden_size, lambda: job.run.seed, lambda: job.validate):
        with pytest.raises(UndeclaredRead, match=r"stage eval read cfg\.\w+(\.\w+)?, .*pipeline/stages.py"):
            read()


def test_the_hash_holds_the_hashed_keys_without_their_runtime_parts():
    cfg = _cfg("train.max_steps=7")
    job = ConfigSlice(cfg, Reads(("train", "aux_layer_ids", "run.seed"), ("train.max_steps", "train.optim.lr")),
                      "train")
    hashed = job.hashed()
    assert set(hashed) == {"train", "aux_layer_ids", "run.seed"}
    assert "max_steps" not in hashed["train"] and "lr" not in hashed["train"]["optim"]
    assert hashed["train"]["epochs"] == cfg.train.epochs and hashed["aux_layer_ids"] == cfg.aux_layer_ids()
    assert job.train.max_steps == 7  # runtime: read, not hashed


@pytest.mark.parametrize("key,value,stages", [
    ("eval.num_prompts", 3, {"eval"}),
    ("train.optim.lr", 1e-5, {"train"}),
    ("train.max_steps", 9, set()),  # cadence: Stage.done handles the length
    ("data.chat_template", "{{ x }}", {"prepare", "eval"}),
    ("target.config_overrides", {"rms_norm_eps": 1e-6}, {"export", "eval", "publish"}),
    ("capture.chunk_tokens", 64, {"capture", "eval"}),
    ("capture.num_slices", 2, set()),
    ("data.num_proc", 4, set()),  # how many processes tokenize: prepare's output is the same (test_prepare.py)
    ("export.repo_id", "o/r", {"publish"}),
])
def test_a_key_changes_the_hash_of_exactly_the_stages_that_read_it(key, value, stages):
    import dataclasses

    base = _cfg()
    section, *path = key.split(".")
    changed = _cfg()
    obj = getattr(changed, section)
    for part in path[:-1]:
        obj = getattr(obj, part)
    setattr(obj, path[-1], value)
    assert dataclasses.asdict(changed) != dataclasses.asdict(base)
    moved = {name for name, stage in STAGES.items()
             if stage.config(base).hashed() != stage.config(changed).hashed()}
    assert moved == stages
