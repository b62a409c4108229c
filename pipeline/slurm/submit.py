"""Fill the Slurm templates (pipeline/slurm/*.sbatch) from a recipe and print the sbatch commands that submit them.

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

A served target (``capture.mode=online capture.engine=vllm --engine-nodes N``): train and pipeline are ONE
heterogeneous job, component 0 the trainer nodes (the batch script and the trainer's step), component 1 the
engine nodes; each trainer rank that leads an engine starts it there through ``capture.engine_launcher``
(an ``srun --het-group=1`` prefix written here). ``--regenerate INPUT:OUTPUT`` first serves the target on
component 1 and re-answers INPUT into OUTPUT (pipeline/slurm/serve.py), then trains on it. docs/slurm.md,
"A served target".
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from fledge.atomic import write_bytes_atomic
from fledge.conf.schema import STAGES, Config
from fledge.pipeline.preflight import compose_checked
from fledge.run_layout import RunLayout

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
    # capture.mode=online capture.engine=vllm only: the het job's engine component (0 nodes: each engine runs
    # beside its trainer rank), its GPUs and CPUs per node (None: as the trainer nodes), and the capture
    # overrides the recipe's engines need there unless the command line sets those keys
    engine_nodes: int = 0
    engine_gpus_per_node: int | None = None
    engine_cpus_per_task: int | None = None
    online: tuple[str, ...] = ()


RESOURCES = {
    "tiny": Resources(gpus_per_node=0, nproc_per_node=2, cpus_per_task=2,
                      time={"prepare": "00:20:00", "capture": "00:30:00", "train": "01:00:00"}),
    "llama3": Resources(),
    "qwen3": Resources(),
    # 16 H200 training + 16 H200 serving (recipes/kimi_k2/capture_plan.md, "Online"): one TP-8 engine per node,
    # each shared by the 8 ranks of one trainer node
    "kimi_k2": Resources(nodes=2, engine_nodes=2,
                         online=("capture.ranks_per_engine=8", "capture.tensor_parallel_size=8")),
}


@dataclass(frozen=True)
class Job:
    """One filled script: where it goes and the sbatch command line that submits it."""

    name: str  # prepare | capture | capture_array | train
    path: Path
    text: str
    depends_on: str | None = None  # shell variable holding the upstream job id
    logs: Path | None = None  # where Slurm writes its log (sbatch does not create the directory)


@dataclass(frozen=True)
class EngineLayout:
    """The engine component of a het job: nodes x GPUs, engines of ``tp`` GPUs, ``cpus`` each."""

    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    engines: int
    tp: int
    cpus: int  # per engine

    def launcher(self) -> list[str]:
        """capture.engine_launcher: one engine = one task on one engine node, with its GPUs and CPUs only
        (--exact: several engines share a node); explicit counts, since the step's environment (SLURM_NTASKS,
        SRUN_CPUS_PER_TASK, SLURM_GPUS_PER_NODE of the trainer step) would otherwise size it."""
        gpus = [f"--gpus-per-node={self.tp}"] if self.gpus_per_node else []
        return ["srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--exact", *gpus,
                f"--cpus-per-task={self.cpus}"]


def hydra_list(words: list[str]) -> str:
    """A Hydra list of strings, each double-quoted (an item with '=' or ',' does not parse bare), quotes and
    interpolations (``${``) escaped."""
    return "[" + ",".join('"' + w.replace('"', '\\"').replace("${", "\\${") + '"' for w in words) + "]"


def engine_layout(cfg, res: Resources, ranks: int) -> EngineLayout:
    """The engines ``ranks`` trainer ranks need (one per capture.ranks_per_engine, capture.tensor_parallel_size
    GPUs each) laid out on the engine nodes; ValueError naming the flag or key when they do not fit."""
    k, tp = cfg.capture.ranks_per_engine, cfg.capture.tensor_parallel_size
    nodes, gpus = res.engine_nodes, res.engine_gpus_per_node
    cpus_node = res.engine_cpus_per_task
    if ranks % k:
        raise ValueError(f"{ranks} trainer ranks do not split into engines of capture.ranks_per_engine={k}: "
                         "make the ranks a multiple of it")
    engines = ranks // k
    if gpus:
        if tp > gpus:
            raise ValueError(f"capture.tensor_parallel_size={tp} GPUs per engine do not fit on one engine node of "
                             f"{gpus} GPUs (--engine-gpus-per-node): an engine runs on one node")
        per_node = gpus // tp
        if nodes * per_node < engines:
            raise ValueError(f"{engines} engines ({ranks} trainer ranks / capture.ranks_per_engine={k}) of "
                             f"capture.tensor_parallel_size={tp} GPUs need {math.ceil(engines / per_node)} engine "
                             f"nodes of {gpus} GPUs; --engine-nodes {nodes} holds {nodes * per_node}")
    else:  # CPU engine nodes (a test cluster): the engines spread evenly
        per_node = math.ceil(engines / nodes)
    if cpus_node // per_node < 1:
        raise ValueError(f"{per_node} engines per node on {cpus_node} CPUs (--engine-cpus-per-task): "
                         "give each at least one")
    return EngineLayout(nodes, gpus, cpus_node, engines, tp, cpus_node // per_node)


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


# The flags that count something, their least value and what they count (for the one-line refusal)
COUNT_FLAGS = {"nodes": (1, "trainer nodes"), "gpus_per_node": (0, "GPUs per node; 0: CPU nodes"),
               "nproc_per_node": (1, "workers per node"), "cpus_per_task": (1, "CPUs per node"),
               "array": (1, "capture slices"), "max_parallel": (1, "array tasks at once"),
               "engine_nodes": (0, "a node count; 0: each engine beside its trainer rank"),
               "engine_gpus_per_node": (0, "GPUs per engine node; 0: CPU nodes"),
               "engine_cpus_per_task": (1, "CPUs per engine node")}


def check_counts(args: argparse.Namespace) -> None:
    """ValueError naming the flag whose count is below its least value (a 0 was replaced by a default, or
    reached sbatch)."""
    for name, (low, meaning) in COUNT_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= {low} ({meaning})")


def check_hub(cfg, stages: str, env=os.environ) -> None:
    """A job whose publish stage will push needs the Hub there: the templates run the stages with
    HF_HUB_OFFLINE=1 unless the environment sbatch passes on sets it, and the job would fail only after the
    queue wait (pipeline/preflight.py ``check_publish``, as the job's start sees it)."""
    if not (cfg.export.push_to_hub and "publish" in stages.strip("[]").split(",")):
        return
    fix = ("or set export.push_to_hub=false (or --stages without publish) and push the export later with "
           "`fledge push RUN_DIR/export ORG/NAME`")
    if (env.get("HF_HUB_OFFLINE") or "1").upper() in ("1", "ON", "YES", "TRUE"):
        raise ValueError("export.push_to_hub=true: the Slurm job runs its publish stage with HF_HUB_OFFLINE=1 (the "
                         "templates' default) and would fail after the queue wait; export HF_HUB_OFFLINE=0 in the "
                         f"shell that runs sbatch (the nodes must reach the Hub), {fix}")
    if not env.get("HF_TOKEN"):
        raise ValueError("export.push_to_hub=true: the Slurm job's publish stage reads the Hub token from HF_TOKEN, "
                         f"unset here; export HF_TOKEN (a write token) in the shell that runs sbatch, {fix}")


# The flags that override a field of Resources of the same name
RESOURCE_FLAGS = ("nodes", "gpus_per_node", "nproc_per_node", "cpus_per_task", "engine_nodes", "engine_gpus_per_node",
                  "engine_cpus_per_task")


def resources(recipe: str, args: argparse.Namespace) -> Resources:
    """The recipe's defaults (1 node x 8 GPUs, with a note, for a recipe without any) with the command line's flags
    applied; the engine nodes' GPUs and CPUs default to the trainer nodes'."""
    res = RESOURCES.get(recipe)
    if res is None:
        print(f"submit: no resource defaults for recipe {recipe!r}; assuming 1 node x 8 GPUs", file=sys.stderr)
        res = Resources()
    res = replace(res, **{k: getattr(args, k) for k in RESOURCE_FLAGS if getattr(args, k) is not None})
    return replace(res, engine_gpus_per_node=res.gpus_per_node if res.engine_gpus_per_node is None
                   else res.engine_gpus_per_node,
                   engine_cpus_per_task=res.cpus_per_task if res.engine_cpus_per_task is None
                   else res.engine_cpus_per_task)


def served_engines(kind: str, args: argparse.Namespace, cfg: Config, res: Resources,
                   overrides: list[str]) -> tuple[Config, list[str], EngineLayout | None]:
    """For a served target on engine nodes (one het job): the config and overrides with the recipe's engine shape
    and the layout's capture.engine_launcher added (unless the command line sets them), and the layout. Any other
    job: ``(cfg, overrides, None)``. ValueError for a flag or job kind a served target cannot take."""
    served = cfg.capture.mode == "online" and cfg.capture.engine == "vllm"
    if args.engine_nodes is not None and not served:
        raise ValueError("--engine-nodes places the engines of a served target: add capture.mode=online "
                         "capture.engine=vllm (or drop --engine-nodes)")
    if not (served and res.engine_nodes):  # 0 engine nodes: one plain job, the engines beside their ranks
        return cfg, overrides, None
    if kind == "capture":
        raise ValueError("capture.mode=online writes no feature store: submit train or pipeline (one "
                         "heterogeneous job) instead of capture")
    if args.array:
        raise ValueError("--array slices an offline capture; a served target streams (no capture array): "
                         "drop --array")
    given = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    overrides = overrides + [o for o in res.online if o.split("=", 1)[0] not in given]  # the recipe's engine shape
    cfg = compose(overrides)
    engines = engine_layout(cfg, res, ranks=res.nodes * (res.nproc_per_node or res.gpus_per_node or 1))
    if cfg.capture.engine_launcher:
        print(f"submit: keeping capture.engine_launcher={cfg.capture.engine_launcher} from the command line "
              f"(the layout would give {engines.launcher()})", file=sys.stderr)
        return cfg, overrides, engines
    overrides = [*overrides, f"capture.engine_launcher={hydra_list(engines.launcher())}"]
    return compose(overrides), overrides, engines  # the override as train/main.py will parse it


def check_request(kind: str, args: argparse.Namespace, cfg: Config, overrides: list[str],
                  engines: EngineLayout | None) -> None:
    """ValueError for flags and overrides the jobs cannot run with (or would fail on only after the queue wait);
    a warning for a flag with no effect."""
    if args.regenerate and engines is None:
        raise ValueError("--regenerate serves the target on the engine nodes of a heterogeneous job: add "
                         "capture.mode=online capture.engine=vllm --engine-nodes N")
    if args.no_api_key and not args.regenerate:
        print("submit: warning: --no-api-key has no effect without --regenerate (nothing is served)", file=sys.stderr)
    if any(o.startswith(("run.stages=", "+run.stages=", "++run.stages=")) for o in overrides):
        raise ValueError("set the stages with --stages, not a run.stages= override (each job sets its own; "
                         "capture array tasks must run the capture stage alone)")
    if kind in ("train", "pipeline"):
        check_hub(cfg, args.stages or ALL_STAGES)
    if args.array:  # what every array task will compose (train.launch adds the slice overrides)
        compose([*overrides, "run.stages=[capture]", f"capture.num_slices={args.array}", "capture.slice_index=0"])


@dataclass(frozen=True)
class Submission:
    """What every job of one ``fledge submit`` shares, composed and checked once by ``plan`` before any job is
    filled (so the jobs cannot disagree on the config or the run directory)."""

    cfg: Config  # the composed config: recipe, run name, output root
    args: argparse.Namespace  # time, partition, account, python
    layout: RunLayout  # rooted where the nodes run
    overrides: tuple[str, ...]  # the user's, less those the knobs set (recipe, run name, output root)
    engines: EngineLayout | None  # a served target's engine component; None: no het job
    regenerate: tuple[str, ...]  # pipeline/slurm/serve.py's arguments, for --regenerate


def render_job(sub: Submission, name: str, template: str, stages: str, res: Resources, extra: tuple[str, ...] = (),
               launch: tuple[str, ...] = (), depends_on: str | None = None, array: str | None = None) -> Job:
    """Job ``name``: ``template`` filled with its #SBATCH lines (``array``: a task range) and knobs (``extra``
    overrides and ``launch`` arguments after the shared ones); the train job of a served target is a het job."""
    nproc = res.nproc_per_node
    slot = "capture" if name == "capture_array" else name
    sbatch = {
        "job-name": f"fledge-{name.replace('_', '-')}-{sub.cfg.run.name}",
        "nodes": str(res.nodes),
        "gpus-per-node": str(res.gpus_per_node) if res.gpus_per_node else None,
        "cpus-per-task": str(res.cpus_per_task),
        "time": sub.args.time or res.time[slot],
        "output": str(sub.layout.logs / ("%x-%A_%a.out" if array else "%x-%j.out")),
        "partition": sub.args.partition, "account": sub.args.account, "array": array,
    }
    knobs = {"RECIPE": sub.cfg.recipe, "RUN_NAME": sub.cfg.run.name, "OUTPUT_ROOT": sub.cfg.run.output_root,
             "STAGES": stages, "OVERRIDES": [*sub.overrides, *extra],
             "LAUNCH_ARGS": [*(["--nproc-per-node", str(nproc)] if nproc else []), *launch],
             "FLEDGE_ROOT": str(Path.cwd()), "PYTHON": sub.args.python}
    het = name == "train" and sub.engines is not None
    if het:
        knobs["REGENERATE"] = list(sub.regenerate)
    text = render((SLURM_DIR / template).read_text(), sbatch, knobs)
    if het:
        text = add_component(text, sub.engines, sbatch)
    return Job(name, sub.layout.slurm_script(name), text, depends_on, sub.layout.logs)


def jobs_of(kind: str, sub: Submission, res: Resources) -> list[Job]:
    """The jobs of ``kind`` in submission order: capture (or prepare and a capture array), train, or both."""
    args, out = sub.args, []
    if kind in ("capture", "pipeline") and sub.engines is None:  # served: prepare runs in the het job itself
        if args.array:
            cpu_only = replace(res, nodes=1, gpus_per_node=0, nproc_per_node=1)
            limit = f"%{args.max_parallel}" if args.max_parallel else ""
            out.append(render_job(sub, "prepare", "capture.sbatch", "[prepare]", cpu_only))
            out.append(render_job(sub, "capture_array", "capture_array.sbatch", "[capture]", res,
                                  launch=("--capture-slices", str(args.array)), depends_on="prepare",
                                  array=f"0-{args.array - 1}{limit}"))
        else:
            out.append(render_job(sub, "capture", "capture.sbatch", args.stages or "[prepare,capture]", res))
    if kind in ("train", "pipeline"):
        slices = (f"capture.num_slices={args.array:d}",) if args.array else ()
        out.append(render_job(sub, "train", "train.sbatch", args.stages or ALL_STAGES, res, extra=slices,
                              depends_on=out[-1].name if out else None))
    return out


def plan(kind: str, args: argparse.Namespace, overrides: list[str]) -> list[Job]:
    """The filled scripts for ``kind`` (capture | train | pipeline) in submission order."""
    check_counts(args)
    cfg = compose(overrides)
    res = resources(cfg.recipe, args)
    cfg, overrides, engines = served_engines(kind, args, cfg, res, list(overrides))
    check_request(kind, args, cfg, overrides, engines)
    # the nodes' working directory may be another (an absolute root stays)
    layout = RunLayout(Path.cwd() / RunLayout.of(cfg.run).root)
    user = tuple(o for o in overrides if not o.startswith(("recipe=", "run.name=", "run.output_root=")))
    regenerate = tuple(regenerate_args(cfg, args, engines, layout)) if args.regenerate else ()
    return jobs_of(kind, Submission(cfg, args, layout, user, engines, regenerate), res)


def add_component(text: str, engines: EngineLayout, sbatch: dict[str, str | None]) -> str:
    """``#SBATCH hetjob`` and the engine component's lines, after the trainer component's (the first)."""
    lines = ["#SBATCH hetjob", f"#SBATCH --nodes={engines.nodes}", "#SBATCH --ntasks-per-node=1"]
    lines += [f"#SBATCH --gpus-per-node={engines.gpus_per_node}"] if engines.gpus_per_node else []
    lines += [f"#SBATCH --cpus-per-task={engines.cpus_per_task}", f"#SBATCH --time={sbatch['time']}"]
    lines += [f"#SBATCH --{k}={sbatch[k]}" for k in ("partition", "account") if sbatch[k]]
    last = list(re.finditer(r"^#{1,2}SBATCH .*$", text, re.M))[-1]
    return text[:last.end()] + "\n" + "\n".join(lines) + text[last.end():]


def regenerate_args(cfg, args: argparse.Namespace, engines: EngineLayout, layout: RunLayout) -> list[str]:
    """pipeline/slurm/serve.py's arguments for the ``--regenerate INPUT:OUTPUT`` pairs; each OUTPUT must be what a
    data source reads, or the job would train on the data it did not regenerate."""
    reads = {s.path for s in cfg.data.sources}
    out = ["--model", cfg.target.name_or_path, "--tensor-parallel-size", str(cfg.capture.tensor_parallel_size),
           "--log", str(layout.logs / "serve.log")]
    for pair in args.regenerate:
        inp, sep, output = pair.rpartition(":")
        if not (sep and inp and output):
            raise ValueError(f"--regenerate {pair!r}: expected INPUT:OUTPUT (a data file or hub id, and the jsonl "
                             "to write)")
        if output not in reads:
            raise ValueError(f"--regenerate {pair!r}: no data source reads {output}; add "
                             f"data.sources.N.path={output} for the source it replaces")
        out += ["--pair", pair]
    if cfg.capture.engine_python:
        out += ["--engine-python", cfg.capture.engine_python]
    if cfg.target.revision:
        out += ["--revision", cfg.target.revision]
    if cfg.target.trust_remote_code:
        out.append("--trust-remote-code")
    if args.regenerate_args:
        out += ["--regenerate-args", args.regenerate_args]
    if args.serve_args:
        out += ["--server-args", args.serve_args]
    if args.no_api_key:
        out.append("--no-api-key")
    return out + ["--", *(cfg.capture.engine_launcher or engines.launcher())]


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
    p.add_argument("--engine-nodes", type=int, metavar="N", help="capture.mode=online capture.engine=vllm: a "
                   "heterogeneous job whose 2nd component, N nodes, runs the engines")
    p.add_argument("--engine-gpus-per-node", type=int, help="GPUs per engine node (default: as --gpus-per-node)")
    p.add_argument("--engine-cpus-per-task", type=int, help="CPUs per engine node (default: as --cpus-per-task)")
    p.add_argument("--regenerate", action="append", metavar="INPUT:OUTPUT", help="with --engine-nodes: first "
                   "serve the target there and re-answer INPUT into OUTPUT (a data source's path); repeatable")
    p.add_argument("--regenerate-args", help="more `fledge regenerate` words, e.g. '--split train_sft "
                   "--concurrency 64'")
    p.add_argument("--serve-args", help="more words for vLLM's OpenAI server, e.g. '--max-model-len 8192'")
    p.add_argument("--no-api-key", action="store_true", help="with --regenerate: serve the target without a key "
                   "(by default the job refuses to unless FLEDGE_API_KEY is exported to sbatch)")
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
