"""End-to-end recipe runs shared by tests/integration and tests/engine (tests/conftest.py's session fixtures).

``run_recipe`` runs a recipe through the README's main command. Run as a script, this module runs the tiny
family recipes (tiny_moe, tiny_mla: target build + recipe, ~8 min of CPU on 2 cores) at the lowest CPU
priority from the start of a pytest session, so they use the cores the rest of the suite leaves idle (engine
and interpreter start-ups, I/O); the ``tiny_family_run`` fixture then waits for their result files instead
of starting them. ``python -m tests.helpers.recipe_runs OUT moe mla`` writes ``OUT/<family>.json`` per family.
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


def main(out: str, *families: str) -> None:
    """Run each family in turn; ``out/<family>.json`` says {ok, run, log} or {ok: false, error}."""
    os.nice(19)  # the suite in the foreground keeps the cores; this run takes what it leaves idle
    root = Path(out)
    for family in families:
        try:
            run, log = run_family(family, root)
            (root / f"{family}.log").write_text(log)
            result = {"ok": True, "run": str(run), "log": str(root / f"{family}.log")}
        except Exception:  # noqa: BLE001 - reported to the waiting fixture, which fails the tests
            result = {"ok": False, "error": traceback.format_exc()[-6000:]}
        tmp = root / f".{family}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(root / f"{family}.json")


if __name__ == "__main__":
    # One thread, as the family targets' golden numbers were measured (recipes/tiny_<family>/golden.json): a
    # build's floating-point sums, hence the target, may depend on the thread count.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.chdir(ROOT)  # .cache/tiny_target (the targets) and train/main.py are relative to the repo root
    main(*sys.argv[1:])
