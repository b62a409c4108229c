"""Nothing outside a run directory or an output Fledge wrote is ever deleted (fledge/owned.py, the one guard):
every path that deletes or replaces a directory is run against a directory of someone else's files, and each
refuses in one line naming that directory and the fix, with every file left as it was. What Fledge wrote it
still replaces, and a ``--force`` the user gave still replaces anything."""

import subprocess
import sys
from dataclasses import replace

import pytest

import fledge.pipeline.runner as runner
import fledge.pipeline.stages as stages
from fledge.atomic import atomic_path
from fledge.conf import compose
from fledge.distributed import init_world
from fledge.models import gguf_import
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.owned import MARK, NotOwned
from fledge.run_layout import RunLayout
from fledge.serving.export import write_drafter
from fledge.serving.serving_config import serving_config
from fledge.testbed import tiny_target
from fledge.train.checkpoint import promote_best
from tests.helpers.cli import ENV
from tests.helpers.gguf import write_gguf
from tests.helpers.models import make_drafter, random_state_dict

SOMEONES = {"build.json": '{"version": 1, "gguf_sha256": "0", "key": "0"}\n', "notes.txt": "mine\n",
            "results/table.csv": "a,b\n1,2\n"}


def someones_dir(path):
    """A directory of someone else's files (with a parsable build.json, as the fault's was)."""
    for name, text in SOMEONES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def files(path) -> dict[str, str]:
    """Every file under ``path`` and its content (binary files as the text Python reads with replacements)."""
    return {str(p.relative_to(path)): p.read_bytes().decode(errors="replace") for p in sorted(path.rglob("*"))
            if p.is_file()}


def refused(call, path, *needles):
    """``call()`` refuses in one line naming ``path`` and ``needles``, and every file in ``path`` survives."""
    with pytest.raises(ValueError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    for n in needles:
        assert n in message, (n, message)
    assert files(path) == SOMEONES
    assert [p.name for p in path.parent.iterdir() if p.name.startswith((f".{path.name}.tmp-", f".{path.name}.old-"))] \
        == []  # no temporaries of atomic_path left
    return message


# ----------------------------------------------------------------------------------------------- import-gguf
class _FakeModel:
    """What import_gguf needs of a loaded model, writing a config.json the way save_pretrained does."""

    config = type("C", (), {"max_position_embeddings": 8})()

    def save_pretrained(self, path, **kw):
        (path / "config.json").write_text("{}")

    def parameters(self):
        return []


class _FakeTok:
    model_max_length = None

    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A whole GGUF file, and import_gguf with the model load replaced (what it writes is what matters here)."""
    monkeypatch.setattr(gguf_import, "_load_gguf", lambda g: (_FakeModel(), _FakeTok()))
    monkeypatch.setattr(gguf_import, "_rebuild", lambda m: m)
    monkeypatch.setattr(gguf_import, "check_logits", lambda *a: 0.0)
    path = tmp_path / "m.gguf"
    write_gguf(path, {"general.architecture": "llama"}, {"w": [1.0, 2.0]})
    return path


def test_import_gguf_out_of_someone_elses_files(tmp_path, gguf):
    out = someones_dir(tmp_path / "out")
    message = refused(lambda: gguf_import.import_gguf(str(gguf), out, log=lambda *a: None), out,
                      "notes.txt", "another --out", "--force", f"deletes everything in {out}")
    assert "build.json" in message  # a build.json alone does not make it Fledge's


def test_import_gguf_replaces_its_own_output_and_force_replaces_anything(tmp_path, gguf):
    out = tmp_path / "out"
    gguf_import.import_gguf(str(gguf), out, log=lambda *a: None)
    assert {"config.json", "tokenizer.json", "build.json", MARK} <= set(files(out))
    (out / "build.json").write_text('{"version": 0}')  # an older import of it: replaced without --force
    gguf_import.import_gguf(str(gguf), out, log=lambda *a: None)
    assert '"version": 1' in (out / "build.json").read_text()
    (out / "notes.txt").write_text("mine")  # a file added since: the import is no longer only Fledge's
    (out / "build.json").write_text('{"version": 0}')
    with pytest.raises(NotOwned, match="notes.txt"):
        gguf_import.import_gguf(str(gguf), out, log=lambda *a: None)
    assert (out / "notes.txt").exists()
    mine = someones_dir(tmp_path / "mine")
    gguf_import.import_gguf(str(gguf), mine, force=True, log=lambda *a: None)  # asked by name: replaced
    assert "notes.txt" not in files(mine) and "config.json" in files(mine)


def test_import_gguf_cli_refuses_in_one_line(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, {"general.architecture": "llama"}, {"w": [1.0]})
    out = someones_dir(tmp_path / "out")
    res = subprocess.run([sys.executable, "-m", "fledge", "import-gguf", str(gguf), "--out", str(out)], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "--force" in lines[0], res.stderr
    assert files(out) == SOMEONES


# ---------------------------------------------------------------------- the other writers of whole directories
def test_tiny_target_out_of_someone_elses_files(tmp_path):
    out = someones_dir(tmp_path / "llama")
    refused(lambda: tiny_target._cached(out, "new-key", lambda tmp: (tmp / "config.json").write_text("{}")), out,
            "another --out")
    own = tmp_path / "own"
    tiny_target._cached(own, "k1", lambda tmp: None)
    tiny_target._cached(own, "k2", lambda tmp: None)  # its own, older build: replaced
    assert '"k2"' in (own / "build.json").read_text()


def _export_config():
    target = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
              "num_attention_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "vocab_size": 256}
    spec = {"fc_norm": True, "norm_output": True, "aux_layer_ids": [2, 3, 4], "draft_vocab_size": 64}
    return serving_config(target, spec, [2, 3, 4], 64)


def test_export_out_of_someone_elses_files(tmp_path):
    config = _export_config()
    out = someones_dir(tmp_path / "drafter")
    refused(lambda: write_drafter(out, random_state_dict(config), config), out)
    own = write_drafter(tmp_path / "own", random_state_dict(config), config)
    write_drafter(own, random_state_dict(config, seed=1), config)  # its own export: replaced
    assert "config.json" in files(own)


def test_drafter_checkpoint_and_best_out_of_someone_elses_files(tmp_path):
    drafter = make_drafter(seed=3)
    ckpt = DrafterCheckpoint(drafter.spec)
    out = someones_dir(tmp_path / "drafter")
    refused(lambda: ckpt.write(out, drafter.state_dict()), out)
    own = ckpt.write(tmp_path / "step_1" / "drafter", drafter.state_dict())
    ckpt.write(own, drafter.state_dict())  # its own checkpoint: replaced
    best = someones_dir(tmp_path / "best")
    refused(lambda: promote_best(own, best), best)


def test_atomic_path_of_someone_elses_directory_writes_nothing(tmp_path):
    out = someones_dir(tmp_path / "out")

    def write():
        with atomic_path(out) as tmp:
            tmp.mkdir()
            raise AssertionError("the work began before the refusal")

    refused(write, out)
    with atomic_path(out, force=True) as tmp:  # the caller's user asked for it by name
        tmp.mkdir()
    assert files(out) == {MARK: files(out)[MARK]}


# ------------------------------------------------------------------------------------------ the run directory
@pytest.fixture
def fake_stages():
    """The pipeline's stage records with stand-in entries that only write a file."""
    def entry(ctx):
        (ctx.stage_dir / "out.txt").write_text(ctx.stage)
        return {}
    return tuple(replace(s, run=entry, check=lambda cfg: None) for s in stages.PIPELINE)


def _cfg(root, *overrides):
    return compose(["recipe=tiny", f"run.output_root={root}", f"target.name_or_path={root}", *overrides])


def test_run_force_on_a_stage_directory_of_someone_elses_files(tmp_path, fake_stages):
    root = tmp_path / "outputs"
    someones_dir(root / "tiny" / "prepare")
    refused(lambda: runner.run_stages(_cfg(root, "run.stages=[prepare]", "run.force=[prepare]"), init_world(),
                                      fake_stages), root / "tiny" / "prepare", "run.name")
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare]"), init_world(), fake_stages)
    (tmp_path / "tiny" / "prepare" / "notes.txt").write_text("in a run's stage: the run's")
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare]", "run.force=[prepare]"), init_world(), fake_stages)
    assert sorted(files(tmp_path / "tiny" / "prepare")) == ["manifest.json", "out.txt"]  # its own: started over


def test_a_stage_of_a_fledge_run_without_its_manifest_runs_into_its_directory(tmp_path, fake_stages):
    """A corrupt store slice's advice is "delete the slice and capture/manifest.json, then run again": the stage
    directory of a run whose other stages hold their manifests is the run's own and runs (deleting nothing);
    the same directory in a directory that is no Fledge run is refused, run.force or not."""
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare,capture]"), init_world(), fake_stages)
    capture = tmp_path / "tiny" / "capture"
    (capture / "manifest.json").unlink()
    (capture / "slice-0.txt").write_text("a slice the stage resumes over")
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare,capture]"), init_world(), fake_stages)
    assert sorted(files(capture)) == ["manifest.json", "out.txt", "slice-0.txt"]
    root = tmp_path / "outputs"
    someones_dir(root / "tiny" / "prepare")
    refused(lambda: runner.run_stages(_cfg(root, "run.stages=[prepare]"), init_world(), fake_stages),
            root / "tiny" / "prepare", "run.name")


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/abs", ""])
def test_a_run_name_that_leaves_the_output_root_is_refused(tmp_path, fake_stages, name):
    """run.name=.. with run.force=[prepare] deleted <output_root>/../prepare. The schema refuses such names too;
    the layout refuses them whatever the config's checks let through."""
    root = tmp_path / "outputs" / "r"
    root.mkdir(parents=True)
    victim = someones_dir(tmp_path / "outputs" / "prepare")
    cfg = _cfg(root, "run.stages=[prepare]", "run.force=[prepare]")
    cfg.run.name = name
    with pytest.raises(ValueError, match=r"^run\.name=.*run\.output_root") as e:
        runner.run_stages(cfg, init_world(), fake_stages)
    assert "\n" not in str(e.value)
    assert files(victim) == SOMEONES
    with pytest.raises(ValueError, match=r"^run\.name="):
        RunLayout.of(cfg.run)


def test_a_stage_linked_from_another_run_is_unlinked_not_emptied(tmp_path, fake_stages):
    """Runs over seeds share one prepare (a symlink): forcing it in one run starts that run's own over and leaves
    the shared one whole."""
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare]"), init_world(), fake_stages)
    base = RunLayout(tmp_path / "tiny")
    seed = RunLayout(tmp_path / "seed1")
    seed.share_stage("prepare", base)
    before = files(base.stage("prepare"))
    runner.run_stages(_cfg(tmp_path, "run.name=seed1", "run.stages=[prepare]", "run.force=[prepare]"), init_world(),
                      fake_stages)
    assert files(base.stage("prepare")) == before
    assert not seed.stage("prepare").is_symlink() and (seed.stage("prepare") / "out.txt").exists()


# Every call that deletes a directory tree in the product, per module, with why it deletes only what Fledge wrote.
# A new one fails the test below: route it through fledge/owned.py (remove_owned, atomic_path) or add it here
# with its reason.
REVIEWED_RMTREE = {
    "fledge/owned.py": (1, "remove_owned: the guard itself"),
    "fledge/atomic.py": (1, "atomic_path's own temporaries (.NAME.tmp-PID, .NAME.old-PID)"),
    "data/features/store.py": (1, "a killed write's leftovers among a rank's own shards, in its store"),
    "data/prepare/build.py": (3, "prepare's own .build staging and the splits it renames over, in prepare/"),
    "data/capture/stream.py": (1, "a rank's own spool in train/stream"),
    "data/capture/engine.py": (2, "spool/ and connector/ in the engine's own work directory"),
    "data/capture/offline.py": (2, "stale rank*/ of an earlier slice attempt; dp-* markers in its work directory"),
    "train/checkpoint.py": (4, "step_* beyond keep_last and *_universal copies, in train/checkpoints"),
}


def test_every_deleting_call_is_the_guard_or_reviewed():
    from tests.helpers.paths import REPO

    found = {}
    for room in ("conf", "data", "evaluation", "fledge", "models", "pipeline", "serving", "testbed", "train"):
        for path in sorted((REPO / room).rglob("*.py")):
            n = path.read_text().count("rmtree(")
            if n:
                found[str(path.relative_to(REPO))] = n
    assert found == {k: n for k, (n, _) in REVIEWED_RMTREE.items()}


def test_a_run_output_of_another_kind_is_not_replaced(tmp_path, fake_stages, gguf):
    """Inside a run's stage directory the run's writers replace their own outputs; another writer pointed at one
    (import-gguf --out at a run's checkpoint) is refused."""
    runner.run_stages(_cfg(tmp_path, "run.stages=[prepare]"), init_world(), fake_stages)
    drafter = make_drafter(seed=3)
    ckpt = DrafterCheckpoint(drafter.spec).write(tmp_path / "tiny" / "prepare" / "best", drafter.state_dict())
    before = files(ckpt)
    with pytest.raises(NotOwned, match="drafter-checkpoint|import-gguf"):
        gguf_import.import_gguf(str(gguf), ckpt, log=lambda *a: None)
    assert files(ckpt) == before
    DrafterCheckpoint(drafter.spec).write(ckpt, drafter.state_dict())  # its own writer: replaced


def test_a_run_directory_holding_someone_elses_config_yaml_is_refused(tmp_path, monkeypatch):
    """fledge run writes the composed config to <run>/config.yaml: over a file of someone else's there it refuses
    in one line before anything is written; over its own (a composed config) it writes."""
    from fledge.pipeline import app

    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("my: own settings\n")
    cfg = _cfg(tmp_path, "run.stages=[prepare]")
    monkeypatch.setattr("fledge.pipeline.runner.run_stages", lambda *a: {})
    with pytest.raises(ValueError, match="config.yaml exists and is not a Fledge run's config") as e:
        app.run(cfg)
    assert "\n" not in str(e.value) and (run_dir / "config.yaml").read_text() == "my: own settings\n"
    (run_dir / "config.yaml").unlink()
    app.run(cfg)
    app.run(cfg)  # its own config.yaml: written over
    assert "recipe: tiny" in (run_dir / "config.yaml").read_text()
