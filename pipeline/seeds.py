"""The multi-run driver: train one run per variant x seed from one prepared data set and one capture.

``sweep`` runs ``train/main.py`` under torchrun: ``<root>/base`` with run.stages=[prepare,capture], then per
variant and seed ``<root>/<variant>_s<seed>`` with run.stages=[train,export,eval] and run.seed=<seed>, its
``prepare`` and ``capture`` directories linked to the base's through the run layout (``RunLayout.share_stage``;
stages not selected are read as they are, pipeline/runner.py; a copy per run would be one feature store per
run). A run whose stages are done is skipped by the runner itself, so re-running resumes. The summary over the
runs' reports is the evaluation's (evaluation/seeds.py); ``fledge compare --train`` enters here
(``compare_main``) and scripts/compare_losses.py calls ``sweep``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fledge.atomic import write_json_atomic
from fledge.conf import compose
from fledge.evaluation import compare
from fledge.run_layout import RunLayout

SHARED_STAGES = ("prepare", "capture")  # made once in <root>/base, read by every run of the sweep


def _train_main(nproc: int, overrides: list[str]) -> None:
    """One run of train/main.py on ``nproc`` ranks; a failed run ends the sweep with its exit code, its ranks
    having said why (pipeline/torchrun.py: a user error stays the rank's one line)."""
    cmd = [sys.executable, "-m", "fledge.pipeline.torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "fledge.train.main", *overrides]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, env=dict(os.environ)).returncode
    if code:
        raise SystemExit(code)


def sweep(root: Path, variants: list[tuple[str, list[str]]], seeds: list[int], nproc: int,
          overrides: list[str]) -> list[str]:
    """Train every (name, overrides) variant at every seed from one base capture; the run directories, seed-major
    (a sweep cut short has every variant at the seeds it finished). Wall times go to <root>/sweep_times.json."""
    root = Path(root).resolve()
    common = [*overrides, f"run.output_root={root}"]
    for _, extra in variants:  # a bad override is one line now, not a failed run after the base capture
        compose([*common, *extra])
    t0 = time.time()
    _train_main(nproc, [*common, "run.name=base", f"run.stages=[{','.join(SHARED_STAGES)}]"])
    base = RunLayout(root / "base")
    times, dirs = {"+".join(SHARED_STAGES): time.time() - t0}, []
    for seed in seeds:
        for tag, extra in variants:
            name = f"{tag}_s{seed}"
            run = RunLayout(root / name)
            run.root.mkdir(parents=True, exist_ok=True)
            for stage in SHARED_STAGES:
                run.share_stage(stage, base)
            t = time.time()
            _train_main(nproc, [*common, f"run.name={name}", f"run.seed={seed}", *extra,
                                "run.stages=[train,export,eval]"])
            times[name] = time.time() - t
            dirs.append(str(run.root))
    write_json_atomic(root / "sweep_times.json", {"seconds": times, "total_s": time.time() - t0})
    print(f"wall seconds: {json.dumps({k: round(v) for k, v in times.items()})}", flush=True)
    return dirs


def compare_main(argv: list[str] | None = None) -> int:
    """``fledge compare``: evaluation/compare.py's report, with ``--train ROOT`` first training both drafters
    over seeds here."""
    return compare.main(argv, sweep=sweep)
