"""Every config value has a domain in the schema (conf/domains.py), found by walking the schema itself: a key
added without one fails here, and every value just outside a key's domain is refused by `fledge config` (as
`fledge run` refuses it) with one line naming the key and exit code 2, before anything runs."""

import dataclasses
import math
from typing import Annotated

import pytest

from fledge import cli
from fledge.conf import compose
from fledge.conf.domains import ByteSize, Elsewhere, Free, Location, OneOf, Range, leaves
from fledge.conf.schema import Config
from tests.helpers.cli import assert_one_line, fledge_run


def undomained(cls) -> list[str]:
    """The keys under ``cls`` that hold a value (not a bool, not a section) and say nothing of its domain."""
    return [leaf.key for leaf in leaves(cls) if leaf.kind is not bool and leaf.domain is None]


def test_every_key_has_a_domain():
    assert undomained(Config) == []
    for leaf in leaves(Config):
        if isinstance(leaf.domain, Free):
            assert leaf.domain.why.strip(), leaf.key  # unbounded on purpose, and says why
        elif leaf.domain is not None:  # every domain names values it refuses: the walk below composes each
            assert leaf.domain.outside(leaf.kind), leaf.key


def test_a_key_added_without_a_domain_is_found():
    """The check above is the schema walk, not a list: a new number, path or choice without a domain fails it."""

    @dataclasses.dataclass
    class Section:
        steps: int = 1
        path: str | None = None
        modes: list[str] = dataclasses.field(default_factory=list)
        ratio: Annotated[float, Range(ge=0)] = 0.5
        limit: Annotated[int, Range(ge=1)] | None = None
        flag: bool = False

    @dataclasses.dataclass
    class Root:
        section: Section = dataclasses.field(default_factory=Section)
        items: list[Section] = dataclasses.field(default_factory=list)

    assert undomained(Root) == ["section.steps", "section.path", "section.modes", "items.0.steps", "items.0.path",
                                "items.0.modes"]


def _hydra(value) -> str:
    """``value`` as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return "nan" if isinstance(value, float) and math.isnan(value) else repr(value)


def _outside_overrides() -> list[tuple[str, str]]:
    """(key, override) for every value just outside every walked key's domain."""
    out = []
    for leaf in leaves(Config):
        if leaf.domain is None:
            continue
        for value in leaf.domain.outside(leaf.kind):
            if isinstance(leaf.domain, Elsewhere):  # the key's whole value
                out.append((leaf.key, f"{leaf.key}={_hydra(value)}"))
            elif leaf.container is dict:
                out.append((leaf.key, f"+{leaf.key}.x={_hydra(value)}"))
            elif leaf.container is list:
                out.append((leaf.key, f"{leaf.key}=[{_hydra(value)}]"))
            else:
                out.append((leaf.key, f"{leaf.key}={_hydra(value)}"))
    return out


OUTSIDE = _outside_overrides()


@pytest.mark.parametrize("key, override", OUTSIDE, ids=[o for _, o in OUTSIDE])
def test_a_value_outside_its_domain_is_one_line_naming_the_key(key, override, capsys):
    """Through the real command (``fledge config``, which refuses what ``fledge run`` refuses), in process."""
    with pytest.raises(SystemExit) as e:
        cli.main(["config", "recipe=tiny", override])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("fledge: "), err
    assert key in err, err


def test_the_walk_covers_the_reported_values():
    """The values reported to compose and then train or measure wrongly are among the walked keys."""
    walked = {key for key, _ in OUTSIDE}
    assert {"train.optim.min_lr_ratio", "drafter.step_weight", "data.max_length", "data.sources.0.weight",
            "run.name", "train.optim.lr", "train.optim.grad_clip", "eval.temperature", "eval.lookup_max_ngram",
            "eval.heldout_steps", "eval.drift_depth", "eval.long_prompt_tokens", "eval.degenerate_threshold",
            "eval.engine_batch_size", "eval.bucket_prompts", "capture.shard_size_mb", "capture.chunk_tokens",
            "data.num_proc", "export.max_shard_size"} <= walked


@pytest.mark.parametrize("override", [
    "train.optim.min_lr_ratio=-1", "drafter.step_weight=-0.8", "drafter.step_weight=nan", "data.max_length=-5",
    "data.sources.0.weight=-1", "run.name=..", "run.name=/", "run.name=/tmp/x", "run.name=.", "run.name=a/b",
    "train.optim.lr=0", "train.optim.grad_clip=-1", "eval.temperature=-1", "eval.lookup_max_ngram=0",
    "eval.heldout_steps=-3", "eval.drift_depth=-1", "eval.long_prompt_tokens=-100", "eval.degenerate_threshold=7",
    "eval.engine_batch_size=-4", "eval.bucket_prompts=-1", "capture.shard_size_mb=0", "capture.chunk_tokens=-1",
    "data.num_proc=-2", "export.max_shard_size=banana", "train.optim.lr=nan", "eval.temperature=inf",
])
def test_the_reported_values_are_refused_when_composed(override):
    key = override.split("=")[0]
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny", override])
    assert str(e.value).startswith(f"{key}="), str(e.value)


def test_each_value_is_checked_against_the_bounds_not_just_named():
    assert compose(["recipe=tiny", "train.optim.min_lr_ratio=1", "drafter.step_weight=1", "eval.temperature=0",
                    "capture.chunk_tokens=0", "eval.degenerate_threshold=0", "run.name=my-run.v2",
                    "export.max_shard_size=500MB"]).run.name == "my-run.v2"
    with pytest.raises(ValueError, match=r"^drafter\.step_weight=1\.5: must be in \(0, 1\] \(step k's loss weighs"):
        compose(["recipe=tiny", "drafter.step_weight=1.5"])
    with pytest.raises(ValueError, match=r"^eval\.temperature=inf: must be finite and >= 0"):
        compose(["recipe=tiny", "eval.temperature=inf"])


@pytest.mark.parametrize("size", ["5GB", "500MB", " 1.5 gb", "10KB", "2TB", "1e3MB", ".5GB", "banana", "5GiB", "5",
                                  "GB", "0GB", "-1GB", "nanGB", "infGB", "5 G B"])
def test_a_size_is_what_the_exports_writer_reads(size):
    """ByteSize accepts exactly what huggingface_hub's parse_size_to_int (save_torch_state_dict's) reads as > 0."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        read = 0 < parse_size_to_int(size)
    except (ValueError, OverflowError):
        read = False
    assert (ByteSize().problem("export.max_shard_size", size) is None) == read


def test_the_schemas_choices_are_the_readers():
    """Choices the schema lists for code it cannot import are that code's."""
    from fledge.data.prepare.perturb import SYSTEM_MODES

    domains = {leaf.key: leaf.domain for leaf in leaves(Config)}
    assert domains["data.perturb.system_modes"] == OneOf(*SYSTEM_MODES)
    assert isinstance(domains["data.sources.0.path"], Location)


def test_a_source_without_a_path_is_one_line_naming_the_key(tmp_path):
    """It was a 69-line MissingMandatoryValue traceback (conf/compose.py)."""
    assert_one_line(fledge_run(tmp_path, "data.sources=[{weight: 1.0}]"),
                    "data.sources.0.path has no value", "data.sources.0.path=VALUE")
    with pytest.raises(ValueError, match=r"^target\.name_or_path has no value .*target\.name_or_path=VALUE"):
        compose(["recipe=tiny", "target.name_or_path=???"])


def test_a_run_name_leaving_its_root_deletes_nothing(tmp_path):
    """run.name=.. with run.force=[prepare] deleted <run.output_root>/../prepare, someone else's directory."""
    theirs = tmp_path / "prepare"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("not Fledge's")
    assert_one_line(fledge_run(tmp_path, "run.name=..", "run.force=[prepare]", "run.stages=[prepare]"),
                    "run.name='..': must be one directory name under run.output_root")
    assert (theirs / "notes.txt").read_text() == "not Fledge's"


def test_fledge_config_refuses_a_late_failing_value_with_exit_code_2(capsys):
    """In process, as the walk above (tests/unit/train/test_user_errors.py runs `fledge config` as a process)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["config", "recipe=tiny", "export.max_shard_size=banana"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "export.max_shard_size='banana': must be a size" in err, err
