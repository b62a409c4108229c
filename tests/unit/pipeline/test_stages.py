"""The pipeline is defined once (pipeline/stages.py PIPELINE): the schema's stage names, the runner's order, its
upstream links and its hashes all come from the records."""

import ast

from fledge.conf import compose
from fledge.conf.schema import STAGES
from fledge.pipeline.stages import PIPELINE
from fledge.stage_inputs import hashed
from tests.helpers.paths import REPO as ROOT


def test_the_schema_lists_the_records_stages_in_order():
    assert tuple(s.name for s in PIPELINE) == STAGES  # conf/schema.py cannot import train/: held here
    names = [s.name for s in PIPELINE]
    for i, s in enumerate(PIPELINE):
        assert s.upstream is None if i == 0 else s.upstream in names[:i], s.name  # each reads an earlier stage


def test_each_record_gives_its_inputs_and_the_runner_names_no_stage():
    """Every stage's inputs come from its record (its dataclass, hashed or runtime field by field); the runner is
    generic (no stage name in its code)."""
    cfg = compose(["recipe=tiny"])
    for s in PIPELINE:
        inputs = s.inputs(cfg)
        assert type(inputs).__name__.lower().startswith(s.name) and hashed(inputs), s.name
    tree = ast.parse((ROOT / "pipeline" / "runner.py").read_text())
    consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not consts & set(STAGES), consts & set(STAGES)


def test_a_prepared_run_keeps_its_output_whatever_data_num_proc(tmp_path):
    """data.num_proc only sets how many processes tokenize (the same output on any count: test_prepare.py), so
    it is read at runtime, not hashed: a prepared run goes on under another value, and a manifest of a Fledge
    that still hashed it (at any value) is kept too, not refused with a force that would redo capture."""
    import json

    from fledge.pipeline import runner
    from fledge.pipeline.stages import STAGES as RECORDS

    def cfg(*overrides):
        return compose(["recipe=tiny", f"run.output_root={tmp_path}", f"target.name_or_path={tmp_path}",
                        "run.stages=[prepare]", *overrides])

    prepare = RECORDS["prepare"]
    inputs = runner.stage_inputs(cfg(), prepare, {})
    # This Fledge's manifest; an older one's, which hashed data.num_proc (16: the value data=sharegpt_ultrachat
    # sets, not the default: a key this Fledge no longer hashes is kept whatever it was).
    for recorded in (None, 1, 16):
        was = json.loads(json.dumps(inputs))
        if recorded is not None:
            was["config"]["data"]["num_proc"] = recorded
        manifest = {"stage": "prepare", "complete": True, "read": {}, "output_id": "x", "inputs": was,
                    "inputs_hash": runner.digest(was)}
        plan = runner.plan_stages(cfg("data.num_proc=4"), [prepare], {"prepare": manifest})["prepare"]
        assert plan.action == "skip", (recorded, plan)
