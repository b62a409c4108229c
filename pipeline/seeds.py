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
from fledge.evaluation import compare
from fledge.pipeline.preflight import check_environment, compose_checked
from fledge.run_layout import RunLayout

SHARED_STAGES = ("prepare", "capture")  # made once in <root>/base, read by every run of the sweep


def _command(nproc: int, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "fledge.pipeline.torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "fledge.train.main", *overrides]
    print("+", " ".join(cmd), flush=True)
    return cmd


def _train_main(nproc: int, overrides: list[str]) -> None:
    """One run of train/main.py on ``nproc`` ranks; a failed run ends the sweep with its exit code, its ranks
    having said why (pipeline/torchrun.py: a user error stays the rank's one line)."""
    code = subprocess.run(_command(nproc, overrides), env=dict(os.environ)).returncode
    if code:
        raise SystemExit(code)


def _run_parallel(jobs: list[tuple[str, Path, list[str]]], nproc: int, parallel: int) -> dict[str, float]:
    """``jobs`` (name, run dir, overrides) at most ``parallel`` at a time, each one's output in <run>/sweep.log
    (a line per finished run here); the first failure waits for the others, then ends the sweep naming its log."""
    times, running, failed = {}, {}, []
    queue = list(jobs)
    while queue or running:
        while queue and len(running) < parallel:
            name, run_dir, overrides = queue.pop(0)
            log = open(run_dir / "sweep.log", "ab")
            proc = subprocess.Popen(_command(nproc, overrides), env=dict(os.environ), stdout=log,
                                    stderr=subprocess.STDOUT)
            running[name] = (proc, log, time.time(), run_dir)
        time.sleep(1.0)
        for name, (proc, log, t, run_dir) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            times[name] = time.time() - t
            print(f"{name}: exit {proc.returncode} after {times[name]:.0f} s (log {run_dir / 'sweep.log'})", flush=True)
            if proc.returncode:
                failed.append((name, proc.returncode, run_dir / "sweep.log"))
                queue.clear()
    if failed:
        name, code, log = failed[0]
        print(f"sweep: run {name} failed (exit {code}); its output is in {log}", file=sys.stderr)
        raise SystemExit(code)
    return times


def sweep(root: Path, variants: list[tuple[str, list[str]]], seeds: list[int], nproc: int,
          overrides: list[str], parallel: int = 1) -> list[str]:
    """Train every (name, overrides) variant at every seed from one base capture; the run directories, seed-major
    (a sweep cut short has every variant at the seeds it finished). ``parallel`` > 1 runs that many at once (small
    drafters on one GPU leave it idle between kernels), each run's output in its sweep.log. Wall times go to
    <root>/sweep_times.json."""
    root = Path(root).resolve()
    common = [*overrides, f"run.output_root={root}"]
    for _, extra in variants:  # a bad override or an eval set not readable here: one line now, not after the capture
        check_environment(compose_checked([*common, *extra]), nproc)
    t0 = time.time()
    _train_main(nproc, [*common, "run.name=base", f"run.stages=[{','.join(SHARED_STAGES)}]"])
    base = RunLayout(root / "base")
    times, dirs, jobs = {"+".join(SHARED_STAGES): time.time() - t0}, [], []
    for seed in seeds:
        for tag, extra in variants:
            name = f"{tag}_s{seed}"
            run = RunLayout(root / name)
            run.root.mkdir(parents=True, exist_ok=True)
            for stage in SHARED_STAGES:
                run.share_stage(stage, base)
            jobs.append((name, run.root, [*common, f"run.name={name}", f"run.seed={seed}", *extra,
                                          "run.stages=[train,export,eval]"]))
            dirs.append(str(run.root))
    if parallel > 1:
        times.update(_run_parallel(jobs, nproc, parallel))
    else:
        for name, _, job in jobs:
            t = time.time()
            _train_main(nproc, job)
            times[name] = time.time() - t
    write_json_atomic(root / "sweep_times.json", {"seconds": times, "total_s": time.time() - t0})
    print(f"wall seconds: {json.dumps({k: round(v) for k, v in times.items()})}", flush=True)
    return dirs


def compare_main(argv: list[str] | None = None) -> int:
    """``fledge compare``: evaluation/compare.py's report, with ``--train ROOT`` first training both drafters
    over seeds here."""
    return compare.main(argv, sweep=sweep)
