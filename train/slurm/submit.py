"""Fill the Slurm templates (train/slurm/*.sbatch) from a recipe and print the sbatch commands that submit them.

    fledge submit train recipe=llama3 --nodes 2 --partition gpu --account proj
    fledge submit pipeline recipe=qwen3 --array 8 --time 24:00:00 train.epochs=5
    fledge submit capture recipe=tiny --dry-run        # print the scripts, write nothing

The recipe is composed (and validated) here exactly as train/main.py will compose it, so a bad override
fails now rather than after a day in the queue. The filled scripts go to RUN_DIR/slurm/<job>.sbatch,
logs to RUN_DIR/logs/; stdout is a shell snippet (pipe it to `bash` to submit), notes go to stderr.

Jobs: `capture` = prepare+capture on one allocation, or with --array N a prepare job followed by an
N-task capture array (each task runs only the capture stage, on slice SLURM_ARRAY_TASK_ID: never
prepare, which would race on one directory); `train` = every stage (complete ones are skipped, so it
resumes; after an array capture, `capture.num_slices=N` makes its capture stage merge the slices, or
name the ones to rerun); `pipeline` = capture then train, chained with --dependency=afterok.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from fledge.atomic import write_bytes_atomic
from fledge.conf.schema import STAGES
from fledge.run_layout import RunLayout
from fledge.train.preflight import compose_checked

SLURM_DIR = Path(__file__).resolve().parent  # the templates beside this file ship with the package
ALL_STAGES = "[" + ",".join(STAGES) + "]"  # publish does nothing without export.push_to_hub


@dataclass(frozen=True)
class Resources:
    """Per-recipe defaults; every field has a command-line flag that beats it."""

    nodes: int = 1
    gpus_per_node: int = 8
    nproc_per_node: int | None = None  # None -> one worker per GPU
    cpus_per_task: int = 64
    time: dict[str, str] = field(default_factory=lambda: {"prepare": "04:00:00", "capture": "24:00:00",
                                                          "train": "48:00:00"})


RESOURCES = {
    "tiny": Resources(gpus_per_node=0, nproc_per_node=2, cpus_per_task=2,
                      time={"prepare": "00:20:00", "capture": "00:30:00", "train": "01:00:00"}),
    "llama3": Resources(),
    "qwen3": Resources(),
}


@dataclass(frozen=True)
class Job:
    """One filled script: where it goes and the sbatch command line that submits it."""

    name: str  # prepare | capture | capture_array | train
    path: Path
    text: str
    depends_on: str | None = None  # shell variable holding the upstream job id
    logs: Path | None = None  # where Slurm writes its log (sbatch does not create the directory)


def render(template: str, sbatch: dict[str, str | None], knobs: dict[str, str | list[str]]) -> str:
    """Rewrite ``#SBATCH --key=`` lines (None -> commented out as ``##SBATCH --key=``) and ``KEY=`` knob
    lines (a list becomes a bash array, each word quoted, so overrides with spaces or brackets survive)."""
    out = template
    for key, value in sbatch.items():
        pattern = re.compile(rf"^#{{1,2}}SBATCH --{re.escape(key)}=.*$", re.M)
        if not pattern.search(out):
            raise AssertionError(f"template has no '#SBATCH --{key}=' line")
        line = f"##SBATCH --{key}=" if value is None else f"#SBATCH --{key}={value}"
        out = pattern.sub(lambda _, line=line: line, out, count=1)
    block_start, block_end = out.index("# ---- knobs"), out.index("# ---- end knobs ----")
    block = out[block_start:block_end]
    for key, value in knobs.items():
        pattern = re.compile(rf"^{key}=.*$", re.M)
        if not pattern.search(block):
            raise AssertionError(f"template has no knob line '{key}='")
        line = f"{key}=({shlex.join(value)})" if isinstance(value, list) else f"{key}={shlex.quote(value)}"
        block = pattern.sub(lambda _, line=line: line, block, count=1)
    return out[:block_start] + block + out[block_end:]


def compose(overrides: list[str]):
    """The validated Config train/main.py would build from these overrides, refused as it would refuse it."""

    return compose_checked(overrides)


def plan(kind: str, args: argparse.Namespace, overrides: list[str]) -> list[Job]:
    """The filled scripts for ``kind`` (capture | train | pipeline) in submission order."""
    cfg = compose(overrides)
    res = RESOURCES.get(cfg.recipe)
    if res is None:
        print(f"submit: no resource defaults for recipe {cfg.recipe!r}; assuming 1 node x 8 GPUs", file=sys.stderr)
        res = Resources()
    res = replace(res, **{k: v for k, v in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node),
                                               ("nproc_per_node", args.nproc_per_node),
                                               ("cpus_per_task", args.cpus_per_task)) if v is not None})
    if args.array is not None and args.array < 1:
        raise ValueError(f"--array {args.array}: need at least 1 slice")
    if any(o.startswith(("run.stages=", "+run.stages=", "++run.stages=")) for o in overrides):
        raise ValueError("set the stages with --stages, not a run.stages= override (each job sets its own; "
                         "capture array tasks must run the capture stage alone)")
    if args.array:  # what every array task will compose (train.launch adds the slice overrides)
        compose([*overrides, "run.stages=[capture]", f"capture.num_slices={args.array}", "capture.slice_index=0"])
    layout = RunLayout.of(cfg.run)
    layout = RunLayout(Path.cwd() / layout.root)  # the nodes' working directory may be another (an absolute root stays)
    user = [o for o in overrides if not o.startswith(("recipe=", "run.name=", "run.output_root="))]

    def job(name: str, template: str, stages: str, res: Resources, extra: list[str], launch: list[str],
            depends_on: str | None = None, array: str | None = None) -> Job:
        nproc = res.nproc_per_node
        launch = (["--nproc-per-node", str(nproc)] if nproc else []) + launch
        slot = "capture" if name == "capture_array" else name
        sbatch = {
            "job-name": f"fledge-{name.replace('_', '-')}-{cfg.run.name}",
            "nodes": str(res.nodes),
            "gpus-per-node": str(res.gpus_per_node) if res.gpus_per_node else None,
            "cpus-per-task": str(res.cpus_per_task),
            "time": args.time or res.time[slot],
            "output": str(layout.logs / ("%x-%A_%a.out" if array else "%x-%j.out")),
            "partition": args.partition, "account": args.account, "array": array,
        }
        knobs = {"RECIPE": cfg.recipe, "RUN_NAME": cfg.run.name, "OUTPUT_ROOT": cfg.run.output_root,
                 "STAGES": stages, "OVERRIDES": user + extra, "LAUNCH_ARGS": launch,
                 "FLEDGE_ROOT": str(Path.cwd()), "PYTHON": args.python}
        text = render((SLURM_DIR / template).read_text(), sbatch, knobs)
        return Job(name, layout.slurm_script(name), text, depends_on, layout.logs)

    jobs: list[Job] = []
    slices = [f"capture.num_slices={args.array:d}"] if args.array else []
    if kind in ("capture", "pipeline"):
        if args.array:
            cpu_only = replace(res, nodes=1, gpus_per_node=0, nproc_per_node=1)
            jobs.append(job("prepare", "capture.sbatch", "[prepare]", cpu_only, [], []))
            jobs.append(job("capture_array", "capture_array.sbatch", "[capture]", res, [],
                            ["--capture-slices", str(args.array)], depends_on="prepare",
                            array=f"0-{args.array - 1}" + (f"%{args.max_parallel}" if args.max_parallel else "")))
        else:
            jobs.append(job("capture", "capture.sbatch", args.stages or "[prepare,capture]", res, [], []))
    if kind in ("train", "pipeline"):
        jobs.append(job("train", "train.sbatch", args.stages or ALL_STAGES, res, slices, [],
                        depends_on=jobs[-1].name if jobs else None))
    return jobs


def commands(jobs: list[Job]) -> list[str]:
    """Shell lines that submit ``jobs`` in order, each waiting on the one it depends on."""
    lines = ["set -e"] if len(jobs) > 1 else []  # piped to bash: stop at the first failed sbatch
    for j in jobs:
        dep = f"--dependency=afterok:${{{j.depends_on}%%;*}} " if j.depends_on else ""
        needed = any(other.depends_on == j.name for other in jobs)
        submit = f"sbatch {'--parsable ' if needed else ''}{dep}{shlex.quote(str(j.path))}"
        lines.append(f"{j.name}=$({submit}) && echo \"{j.name}: job ${j.name}\"" if needed else submit)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other arguments: Hydra overrides "
                                "(recipe=NAME required), passed to every job.")
    p.add_argument("kind", choices=["capture", "train", "pipeline"])
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, help="0 for CPU-only nodes (then set --nproc-per-node)")
    p.add_argument("--nproc-per-node", type=int, help="workers per node (default: one per GPU)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per node (one srun task per node)")
    p.add_argument("--time", help="wall-clock limit, e.g. 24:00:00 (default: per recipe and job)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--array", type=int, metavar="N", help="capture as an N-task array job over data slices")
    p.add_argument("--max-parallel", type=int, metavar="K", help="run at most K array tasks at once (%%K)")
    p.add_argument("--run-name", help="run directory name (default: the recipe's run.name)")
    p.add_argument("--stages", help="override the job's stage list, e.g. '[train,export]'")
    p.add_argument("--python", default=".venv/bin/python", help="interpreter on the nodes (relative to the repo)")
    p.add_argument("--dry-run", action="store_true", help="print the scripts and commands; write nothing")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-") or "=" not in o]
    if bad:
        p.error(f"unrecognised arguments {bad} (Hydra overrides look like key=value)")
    if not any(o.startswith("recipe=") for o in overrides):
        p.error("name a recipe: recipe=tiny | recipe=llama3 | recipe=qwen3")
    if args.run_name:
        overrides.append(f"run.name={args.run_name}")
    try:
        jobs = plan(args.kind, args, overrides)
    except ValueError as e:
        print(f"submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for j in jobs:
            print(f"# ===== {j.path} (not written: --dry-run) =====\n{j.text}")
    else:

        for j in jobs:
            write_bytes_atomic(j.path, j.text.encode())
            j.logs.mkdir(parents=True, exist_ok=True)  # sbatch won't create it
            print(f"submit: wrote {j.path}", file=sys.stderr)
    print("\n".join(commands(jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
