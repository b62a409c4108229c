"""The drafter checkpoint (models/drafter_checkpoint.py): the one owner of a trained drafter's files. A round
trip keeps the description and the tensors exactly, an export's record says what the linter needs, a missing or
garbled file is one ValueError naming it, and no other module spells the file names."""

import json
import re

import pytest
import torch

from fledge.models.drafter_checkpoint import META, RECORD, TRAINED_WITH, WEIGHTS, DrafterCheckpoint
from fledge.owned import MARK
from tests.helpers.models import make_drafter
from tests.helpers.paths import REPO

ROOMS = ("fledge", "conf", "models", "data", "serving", "evaluation", "testbed", "train")


@pytest.fixture(scope="module")
def drafter():
    return make_drafter(seed=3)


def _checkpoint(drafter, step=12) -> DrafterCheckpoint:
    return DrafterCheckpoint(drafter.spec, target={"name_or_path": "org/target", "revision": None},
                             training={"recipe": "tiny", "loss": "soft_ce"}, step=step, metrics={"acc_0": 0.5})


def test_round_trip_keeps_the_description_and_the_tensors(drafter, tmp_path):
    written = _checkpoint(drafter)
    d = written.write(tmp_path / "drafter", drafter.state_dict())
    assert sorted(p.name for p in d.iterdir()) == sorted([WEIGHTS, META, MARK])  # nothing else, no temp dir left
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]
    assert DrafterCheckpoint.read(d) == written
    back = DrafterCheckpoint.tensors(d)
    sd = drafter.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    # a later save replaces the directory whole
    written.at_step(13).write(d, drafter.state_dict())
    assert DrafterCheckpoint.read(d).step == 13 and written.step == 12


def test_record_is_what_an_export_keeps(drafter, tmp_path):
    trained = _checkpoint(drafter)
    record = trained.record()
    spec = drafter.spec.to_dict()
    assert record["spec"] == spec and record["trained_with"] == {k: spec[k] for k in TRAINED_WITH}
    assert (record["step"], record["metrics"], record["target"]) == (12, {"acc_0": 0.5}, trained.target)
    assert "training" not in record  # how it was trained stays in the checkpoint
    assert DrafterCheckpoint.read_record(tmp_path) is None  # a public checkpoint has none
    trained.write_record(tmp_path)
    assert json.loads((tmp_path / RECORD).read_text()) == record == DrafterCheckpoint.read_record(tmp_path)
    assert DrafterCheckpoint.record_spec(record) == drafter.spec
    assert DrafterCheckpoint.record_spec(None) is None and DrafterCheckpoint.record_spec({"step": 1}) is None


def test_a_missing_or_garbled_file_names_it(drafter, tmp_path):
    d = _checkpoint(drafter).write(tmp_path / "drafter", drafter.state_dict())
    (d / META).unlink()
    with pytest.raises(ValueError, match=rf"{re.escape(str(d))}: not a Fledge drafter checkpoint \(no {META};"):
        DrafterCheckpoint.read(d)
    with pytest.raises(ValueError, match=f"no {WEIGHTS} and no {META}"):
        DrafterCheckpoint.read(tmp_path)

    d = _checkpoint(drafter).write(tmp_path / "garbled", drafter.state_dict())
    (d / META).write_text('{"spec": ')
    with pytest.raises(ValueError, match=re.escape(f"{d / META}: not valid JSON")):
        DrafterCheckpoint.read(d)
    (d / META).write_text(json.dumps({"spec": {**drafter.spec.to_dict(), "wings": 2}}))
    with pytest.raises(ValueError, match=re.escape(f"{d / META}: its spec is not a drafter's") + ".*wings"):
        DrafterCheckpoint.read(d)
    (d / META).write_text(json.dumps({"step": 3}))
    with pytest.raises(ValueError, match=re.escape(f"{d / META}: not a drafter checkpoint's description (no spec)")):
        DrafterCheckpoint.read(d)
    bad = drafter.spec.to_dict()
    bad["aux_layer_ids"] = [2, 3, 99]  # past the target's layers: DrafterSpec's own check
    (d / META).write_text(json.dumps({"spec": bad}))
    with pytest.raises(ValueError, match=re.escape(f"{d / META}: its spec is not a drafter's")):
        DrafterCheckpoint.read(d)

    (d / WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=re.escape(f"{d / WEIGHTS}: not a readable safetensors file")):
        DrafterCheckpoint.tensors(d)


def test_no_other_module_spells_the_file_names():
    """The checkpoint's and the record's file names live in models/drafter_checkpoint.py alone."""
    owner = REPO / "models" / "drafter_checkpoint.py"
    names = "|".join(re.escape(n) for n in (META, RECORD))
    pattern = re.compile(f"[\"']({names})[\"']")
    found = [f"{p.relative_to(REPO)}:{i}" for room in ROOMS for p in sorted((REPO / room).rglob("*.py"))
             if p != owner for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, f"spelled outside models/drafter_checkpoint.py: {found}"
