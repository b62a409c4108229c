"""A user's mistake reaches them as one line naming the file, line or key and the fix, with exit code 2;
tracebacks are for bugs and for FLEDGE_DEBUG=1. Runs the real entry point (``fledge run``) in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import ENV, assert_one_line, fledge_run, prepare_only
from tests.helpers.suites import FULL_ONLY


def test_file_that_is_not_utf8_names_file_and_line(tmp_path, random_tiny_target):
    src = tmp_path / "chat.jsonl"
    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    src.write_bytes(good + b"\xff\xfe not text\n")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src))
    assert_one_line(res, f"{src}:2: not UTF-8", "re-encode the file as UTF-8", "data.on_error=skip")


def test_empty_source_is_named(tmp_path, random_tiny_target):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src))
    assert_one_line(res, f"{src}: no rows", "data.sources[0]")


def test_bad_override_is_one_line_naming_the_key(tmp_path):
    assert_one_line(fledge_run(tmp_path, "drafter.ttt_steps=0"), "drafter.ttt_steps=0")
    assert_one_line(fledge_run(tmp_path, "drafter.bogus=1"), "drafter.bogus")
    assert_one_line(fledge_run(tmp_path, "train.eval_every=0"), "train.eval_every=0: must be >= 1")
    res = fledge_run(tmp_path, "drafter=nope")  # Hydra's report of a missing option spans 14 lines
    assert_one_line(res, "Could not find 'drafter/nope'; the options in 'drafter': dflash, dspark, eagle3, eagle31, "
                    "mtp, p_eagle")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def _fledge(tmp_path, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fledge", *args], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, needles", [
    (["lint", "DIR", "--target", "/nonexistent"], ["--target /nonexistent: no such path", "a hub id (org/name)"]),
    (["lint", "DIR", "--recipe", "nope"], ["Could not find 'recipe/nope'; the options in 'recipe': ", "llama3"]),
    (["regenerate", "--input", "/nope.jsonl", "--output", "OUT", "--endpoint", "http://127.0.0.1:9", "--model", "m"],
     ["data source '/nope.jsonl': no such file or directory"]),
    (["compare", "--train", "ROOT", "--", "recipe=nope"], ["Could not find 'recipe/nope'"]),
])
def test_tools_refuse_bad_input_in_one_line(tmp_path, args, needles):
    """Each was a traceback (an OSError from transformers, Hydra's error, a ValueError with a good message, a
    CalledProcessError of the first torchrun)."""
    (tmp_path / "DIR").mkdir()
    args = [str(tmp_path / a) if a in ("DIR", "OUT", "ROOT") else a for a in args]
    res = _fledge(tmp_path, *args)
    assert_one_line(res, *needles)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_ranks_user_error_under_torchrun_is_its_one_line(tmp_path):
    """A rank's user error (exit code 2) was followed by torchrun's ChildFailedError traceback and failure box:
    `fledge run --nproc-per-node N` runs torchrun's agent in its own process (pipeline/torchrun.py), and so do the
    Slurm launcher and `fledge compare --train`, whose failed run is its exit code, not a CalledProcessError."""
    bad = f"target.name_or_path={tmp_path / 'no_such_target'}"  # composes; the runner refuses it in the rank
    res = _fledge(tmp_path, "run", "--nproc-per-node", "1", "recipe=tiny", f"run.output_root={tmp_path / 'out'}",
                  "run.stages=[prepare]", bad)
    assert_one_line(res, f"{bad}: no such directory")
    assert "ChildFailedError" not in res.stderr and "exitcode" not in res.stderr, res.stderr
    res = _fledge(tmp_path, "compare", "--train", str(tmp_path / "sweep"), "--", "recipe=tiny", bad)
    assert_one_line(res, f"{bad}: no such directory")
    assert "ChildFailedError" not in res.stderr and "CalledProcessError" not in res.stderr, res.stderr


def test_a_rank_that_fails_otherwise_is_named_in_one_line(tmp_path):
    """A bug's exit code (its traceback is the rank's) or a signal: one line naming the rank and the code."""
    (tmp_path / "bug.py").write_text("import sys\nsys.exit(3)\n")
    res = subprocess.run([sys.executable, "-m", "fledge.pipeline.torchrun", "--standalone", "--nproc_per_node=1",
                          str(tmp_path / "bug.py")], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr
    assert [x for x in res.stderr.splitlines() if x.startswith("fledge: ")] == [
        "fledge: rank 0 failed with exit code 3 (its output is above)"], res.stderr


def test_missing_target_is_a_user_error(tmp_path):
    res = fledge_run(tmp_path, "run.stages=[prepare]", f"target.name_or_path={tmp_path / 'no_such_target'}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-4000:]
    assert "no_such_target" in res.stderr


@pytest.mark.parametrize("var", ["FLEDGE_DEBUG", "HYDRA_FULL_ERROR"])
def test_debug_shows_the_traceback(tmp_path, random_tiny_target, var):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = fledge_run(tmp_path, *prepare_only(tmp_path, random_tiny_target, src), env={**ENV, var: "1"})
    assert res.returncode != 0 and "Traceback" in res.stderr and "no rows" in res.stderr


@pytest.fixture(scope="module")
def captured(tmp_path_factory, random_tiny_target, tiny_data):
    """(dir, overrides) of a prepared and captured tiny run (random target, 16 conversations); tests copy it."""
    root = tmp_path_factory.mktemp("captured")
    ov = (f"target.name_or_path={random_tiny_target}",
          f"data.sources=[{{path: {tiny_data}/train.jsonl, max_samples: 16}}]",
          f"data.eval_sources=[{{path: {tiny_data}/eval.jsonl, max_samples: 4}}]", "train.eval_every=100")
    res = fledge_run(root, "run.stages=[prepare,capture]", *ov)
    assert res.returncode == 0, res.stderr[-4000:]
    return root, ov


def _copy_run(captured, tmp_path):
    import shutil

    shutil.copytree(captured[0] / "out", tmp_path / "out")
    return tmp_path / "out" / "tiny"


@FULL_ONLY  # CI twin: tests/distributed/test_train.py test_a_skipped_step_with_accumulation_resumes_exactly
def test_diverged_training_is_one_line_whose_advice_trains(tmp_path, captured):
    """max_nonfinite steps in a row skipped is the user's setting (the learning rate) or data, not a bug."""
    _copy_run(captured, tmp_path)
    ov = (*captured[1], "run.stages=[train]", "train.max_steps=3", "train.max_nonfinite=2",
          "train.optim.warmup_steps=0", "train.optim.schedule=constant")
    res = fledge_run(tmp_path, *ov, "train.optim.lr=1e30")  # step 1 sends the weights to 1e30: every loss after is NaN
    assert_one_line(res, "2 optimizer steps in a row", "train.optim.lr", "run.force=[train]", "train.max_nonfinite")
    res = fledge_run(tmp_path, *ov, "train.optim.lr=1e-4", "run.force=[train]")  # the advice
    assert res.returncode == 0, res.stderr[-4000:]


# The full suite's (FLEDGE_ENGINE_FULL=1, CI's 30 minutes): CI converts a checkpoint for another world size in
# tests/distributed/test_run_changes.py.
@FULL_ONLY
def test_failed_universal_conversion_is_one_line_whose_advice_resumes(tmp_path, captured):
    """A checkpoint DeepSpeed cannot convert for another world size (here: saved on "2 ranks" and missing
    its optimizer state) names the checkpoint, the world it was saved on and the ways on; the earlier
    checkpoint the message names then resumes."""
    import json

    run = _copy_run(captured, tmp_path)
    ov = (*captured[1], "run.stages=[train]", "train.max_steps=2", "train.save_every=1", "train.keep_last=2")
    assert fledge_run(tmp_path, *ov).returncode == 0
    ckpt = run / "train" / "checkpoints"
    state = json.loads((ckpt / "step_00000002" / "trainer.json").read_text())
    (ckpt / "step_00000002" / "trainer.json").write_text(json.dumps({**state, "world_size": 2}))
    for f in (ckpt / "step_00000002").glob("*optim_states.pt"):
        f.unlink()
    manifest = json.loads((run / "train" / "manifest.json").read_text())  # as if killed after that checkpoint
    (run / "train" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    res = fledge_run(tmp_path, *ov)
    assert_one_line(res, "step_00000002", "saved on 2 ranks", "run.force=[train]", "step_00000001",
                    str(ckpt / "latest"))
    assert not (ckpt / "step_00000002_universal").exists()  # nothing half-converted left behind
    (ckpt / "latest").write_text("step_00000001")  # the advice: resume from the checkpoint before it
    res = fledge_run(tmp_path, *ov)
    assert res.returncode == 0, res.stderr[-4000:]
    assert json.loads((ckpt / "step_00000002" / "trainer.json").read_text())["world_size"] == 1


def test_fledge_config_refuses_what_fledge_run_refuses(tmp_path):
    """`fledge config` composes through the same start-up checks as `fledge run` (pipeline/preflight.py): a loss
    no registry holds is one line naming the key, the choices and where losses are registered."""
    res = subprocess.run([sys.executable, "-m", "fledge", "config", "recipe=tiny", "drafter.loss=nope"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert_one_line(res, "drafter.loss='nope': expected one of [", "'ttt_ce'", "train/losses")


def test_a_bad_data_file_on_two_ranks_is_rank_0s_one_line(tmp_path, random_tiny_target, tiny_data):
    """The README's main command on 2 ranks with a malformed row: rank 0 alone prepares, and its error was its one
    line followed by rank 1's gloo traceback from the barrier it waited at (prepare's outcome was not broadcast,
    as export's was): every rank now exits with rank 0's one line."""
    src = tmp_path / "chat.jsonl"
    good = Path(tiny_data, "train.jsonl").read_text().splitlines()[:3]
    src.write_text("\n".join([*good, '{"messages": [oops', *good]) + "\n")
    res = _fledge(tmp_path, "run", "--nproc-per-node", "2", "recipe=tiny", f"run.output_root={tmp_path / 'out'}",
                  *prepare_only(tmp_path, random_tiny_target, src)[1:])
    assert_one_line(res, f"{src}:4: malformed JSON", "data.on_error=skip")
    assert "gloo" not in res.stderr and "exitcode" not in res.stderr, res.stderr
