"""The pipeline, defined once: one :class:`~fledge.pipeline.runner.Stage` record per stage in :data:`PIPELINE`.

A record says everything the runner needs (pipeline/runner.py): the stage's work, the stage it reads, the
config values its output depends on (its inputs: a slice of the config, hashed), whether a changed input
rebuilds it or stops the run, when a complete stage has more to do, and what must hold before it runs.
The schema's list of stage names (conf/schema.py ``STAGES``, which cannot import this module) is held to
these records by tests/unit/pipeline/test_stages.py. Adding a stage is one record here and its name there.

A stage function is glue only: it reads what it needs from its context (config, world, the run's layout,
upstream manifests), decides which ranks work, and hands the library that owns the work the paths it reads
and writes (fledge/run_layout.py names them): data/prepare, data/capture, the trainer, serving/export.py,
evaluation/evaluate.py, pipeline/publish.py. Each stage function imports that library when it runs, so a
command loads only the libraries of the stages it runs (planning the others reads their manifests).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fledge.conf.schema import Config, TargetConfig
from fledge.distributed import broadcast_object
from fledge.pipeline.runner import Refused, Stage, StageContext
from fledge.stage_context import Reads

log = logging.getLogger(__name__)

# What each stage reads of the config (stage_context.Reads): the runner hashes the hashed keys and the stage
# sees nothing else. Runtime keys lay out or pace the work, and a run in flight may change them.
TRAIN_CADENCE = ("max_steps", "epochs", "save_every", "keep_last", "eval_every", "eval_batches", "log_every",
                 "max_nonfinite")
# How the work is laid out over ranks (tests/distributed/test_train.py checks each on a resumed run): the rows
# split over a sequence-parallel group, and the optimizer step made of grad_accum micro-batches on each
# data-parallel rank. A run resumes at the global batches it consumed on any world size x grad_accum; a step
# of another size is the trainer's warning (train/trainer.py), not a new run: a requeued job on fewer nodes
# must be able to go on.
LAYOUT_KEYS = ("sequence_parallel", "grad_accum")
PUBLISH_KEYS = ("push_to_hub", "repo_id", "private")  # the publish stage's inputs; the export stage's are the rest
ENGINE_KEYS = ("engine", "tensor_parallel_size", "expert_parallel", "data_parallel_size")
# capture.mode=online: the capture keys that change the states the trainer gets (with the target and the aux ids);
# the rest (buffer, restarts, parallelism, batch sizes) is how the engine runs, so a run in flight may change it
ONLINE_STATE_KEYS = ("mode", "engine", "dtype")
# The engine's python, patience and placement, and which slice of an array capture this task writes: how the
# capture runs, not what it stores (the array's tasks and its merge share one hash).
CAPTURE_RUNTIME = ("engine_python", "engine_timeout_s", "engine_launcher", "ranks_per_engine", "num_slices",
                   "slice_index")
# The target as the stages that load it read it (from its files): its inline config is export's (and the card's).
TARGET_LOADED = tuple(f"target.{f.name}" for f in dataclasses.fields(TargetConfig) if f.name != "config_overrides")


def _keys(section: str, names) -> tuple[str, ...]:
    return tuple(f"{section}.{n}" for n in names)


# ------------------------------------------------------------------------------------------ prepare
def prepare(ctx: StageContext) -> dict:
    """Tokenize the chat data with assistant-only masks and build the draft vocab (rank 0 works; its outcome,
    summary or error, reaches every rank, as export's does)."""
    from fledge.data.prepare.build import prepare as build

    cfg = ctx.cfg
    return _on_main(ctx, lambda: build(cfg.data, cfg.target, cfg.drafter.draft_vocab_size, cfg.run.seed,
                                       ctx.layout.prepare))


def prepare_reads(cfg: Config) -> Reads:
    """The data section, the target's tokenizer, the vocab size and the seed; data.num_proc only sets how many
    processes tokenize (map keeps the row order: the same output on any count)."""
    return Reads((*TARGET_LOADED, "data", "drafter.draft_vocab_size", "run.seed"), ("data.num_proc",))


def check_sources(cfg: Config) -> None:
    """Before prepare runs: every local data source exists (a tiny recipe's names its build command)."""
    from fledge.data.prepare.sources import check_source
    from fledge.testbed.hints import build_hint

    for src in [*cfg.data.sources, *cfg.data.eval_sources]:
        check_source(src.path, build_hint(src.path))


# ------------------------------------------------------------------------------------------ capture
def capture(ctx: StageContext) -> dict:
    """Capture the target's states for every prepared split into the feature store (all ranks)."""
    from fledge.data.capture.offline import capture as run_capture

    cfg, prep = ctx.cfg, ctx.layout.prepare
    if cfg.capture.mode == "offline" and not prep.split("train").exists():
        raise ValueError(f"{prep.split('train')} does not exist: run the prepare stage first "
                         "(run.stages=[prepare,capture])")
    return run_capture(cfg.target, cfg.capture, cfg.aux_layer_ids(), ctx.world, prep, ctx.layout.capture,
                       ctx.upstream.get("prepare"), array_script=ctx.layout.slurm_script("capture_array"))


def capture_reads(cfg: Config) -> Reads:
    """The target, the aux ids and the capture section; offline with engine=hf the vLLM keys are not read,
    online only ONLINE_STATE_KEYS change the states."""
    runtime = _keys("capture", CAPTURE_RUNTIME)
    if cfg.capture.mode == "online":
        runtime = _keys("capture", (f.name for f in dataclasses.fields(cfg.capture)
                                    if f.name not in ONLINE_STATE_KEYS))
    elif cfg.capture.engine == "hf":
        runtime += _keys("capture", ENGINE_KEYS)
    return Reads((*TARGET_LOADED, "capture", "aux_layer_ids"), runtime)


# ------------------------------------------------------------------------------------------ train
def train(ctx: StageContext) -> dict:
    """Train the drafter with training-time test under DeepSpeed (all ranks)."""
    from fledge.train.trainer import run_training

    return run_training(ctx)


def train_reads(cfg: Config) -> Reads:
    """The drafter, the optimizer and what the states are (the target, and how capture reads it: online, the
    states come from here); the run's length, cadence and layout over ranks are runtime (Stage.done and the
    trainer handle them), as are the rest of the capture keys (offline they find capture's store, whose own
    hash covers what it holds; online they run the engine) and where the metrics go."""
    return Reads(("drafter", "train", "deepspeed", *TARGET_LOADED, "aux_layer_ids", "run.seed",
                  *_keys("capture", ONLINE_STATE_KEYS)),
                 (*_keys("train", TRAIN_CADENCE + LAYOUT_KEYS), "capture", "logging", "run.name", "recipe"))


def trained_enough(manifest: dict, cfg: Config) -> bool:
    """Whether a complete train stage reached the steps ``cfg`` asks for. More asked: False, and the runner
    runs it again, training on from its last checkpoint (export, eval and publish then rebuild on it).
    Fewer asked than trained: a ValueError, since a run does not train backwards."""
    from fledge.train.checkpoint import planned_steps

    out = manifest.get("outputs") or {}
    done, t = int(out.get("steps", 0)), cfg.train
    ways = ("a run does not train backwards: run.force=[train] starts train over (deleting its checkpoints), or a "
            "new run.name trains the shorter run beside this one")
    if "global_batches_per_epoch" not in out:  # recorded before train kept its epoch's size: epochs not comparable
        asked = t.max_steps or done
    else:
        per_epoch, per_step = out["global_batches_per_epoch"], out["global_batches_per_step"]
        batches = out.get("global_batches", done * per_step)
        if not t.max_steps and t.epochs * per_epoch < batches:
            raise ValueError(f"train: this run has consumed {batches} global batches ({done} steps) and "
                             f"train.max_steps=0 and train.epochs={t.epochs} asks for {t.epochs * per_epoch}; {ways}")
        asked = planned_steps(t.max_steps, t.epochs, done, batches, per_step, per_epoch)
    if asked < done:
        raise ValueError(f"train: this run has trained {done} steps and train.max_steps={t.max_steps} asks for "
                         f"{asked}; {ways}")
    return asked == done


# ------------------------------------------------------------------------------------------ export
def export(ctx: StageContext) -> dict:
    """Checkpoint -> serving directory, linted (rank 0 works; its outcome, summary or error, reaches every
    rank so none waits on a failed one)."""
    return _on_main(ctx, lambda: _export(ctx.cfg, ctx.layout.export.drafter, checkpoint_of(ctx)))


def export_reads(cfg: Config) -> Reads:
    # What export reads besides the checkpoint: the target's config (its local config.json, which the
    # fingerprint covers, else target.config_overrides, else the hub's: serving/export.py load_target_config),
    # the target's name and the draft length (the speculators dialect writes both).
    return Reads(("export", "target", "eval.draft_tokens"), _keys("export", PUBLISH_KEYS))


def _export(cfg: Config, out: Path, ckpt: Path) -> dict:
    from fledge.serving.export import export_checkpoint, load_target_config
    from fledge.serving.lint import format_findings, lint_drafter

    target = load_target_config(cfg.target)
    export_checkpoint(ckpt, out, target, fmt=cfg.export.format, max_shard_size=cfg.export.max_shard_size,
                      target_name=cfg.target.name_or_path, speculative_tokens=cfg.eval.draft_tokens)
    findings = lint_drafter(out, target) if cfg.export.lint else []
    for f, line in zip(findings, format_findings(findings)):
        (log.info if f.level == "note" else log.warning)("lint: %s", line)
    n_err, n_warn = (sum(f.level == level for f in findings) for level in ("error", "warning"))
    summary: dict[str, Any] = {"drafter": str(out), "checkpoint": str(ckpt), "format": cfg.export.format,
                               "lint_errors": n_err, "lint_warnings": n_warn,
                               "files": sorted(p.name for p in out.iterdir())}
    if n_err:
        raise ValueError(f"export: the drafter in {out} fails the linter with {n_err} error(s) (logged above); "
                         "fix them (or set export.lint=false to keep it unpublished)")
    return summary


@dataclasses.dataclass(frozen=True)
class TrainOutputs:
    """What the train stage hands on, from its manifest's ``outputs`` (train/trainer.py writes them): its last
    and best drafter checkpoints (models/drafter_checkpoint.py) and its best AL estimate."""

    last: Path
    best: Path
    best_al_estimate: float | None

    @classmethod
    def of(cls, ctx: StageContext) -> TrainOutputs | None:
        """This run's, or None when its train stage has not completed."""
        out = (ctx.upstream.get("train") or {}).get("outputs")
        if not out:
            return None
        return cls(Path(out["last"]), Path(out["best"]), out["best_al_estimate"])


@dataclasses.dataclass(frozen=True)
class ExportOutputs:
    """What the export stage hands on, from its manifest's ``outputs`` (:func:`_export` writes them)."""

    drafter: Path  # the serving directory

    @classmethod
    def of(cls, ctx: StageContext) -> ExportOutputs:
        out = (ctx.upstream.get("export") or {}).get("outputs")
        if not out:
            raise ValueError(f"{ctx.stage}: the export stage's manifest names no drafter directory; run the export "
                             "stage (run.stages=[export,eval])")
        return cls(Path(out["drafter"]))


def checkpoint_of(ctx: StageContext) -> Path:
    """export.checkpoint = best | last | a path (relative: to the run directory) -> the checkpoint directory."""
    which = ctx.cfg.export.checkpoint
    if which in ("best", "last"):
        trained = TrainOutputs.of(ctx)
        if trained is None:
            raise ValueError(f"export.checkpoint={which}: the train stage's manifest names no such checkpoint")
        p = trained.best if which == "best" else trained.last
    else:
        p = Path(which)
    if not p.is_absolute() and not p.exists() and (ctx.layout.root / p).exists():
        p = ctx.layout.root / p
    if not p.is_dir():
        raise ValueError(f"export.checkpoint={which}: {p} is not a directory")
    return p


# ------------------------------------------------------------------------------------------ eval
def evaluate(ctx: StageContext) -> dict:
    """Measure the exported drafter: acceptance, baselines, drift (rank 0 works; its outcome, summary or
    error, reaches every rank, so a failed check, e.g. the engine's, does not leave the others waiting)."""
    from fledge.evaluation.evaluate import evaluate_run

    trained = TrainOutputs.of(ctx)
    return _on_main(ctx, lambda: evaluate_run(ctx.cfg, ctx.layout.prepare, ctx.layout.eval,
                                              ExportOutputs.of(ctx).drafter, ctx.world.device,
                                              metrics_path=ctx.layout.train.metrics,
                                              train_al_estimate=trained.best_al_estimate if trained else None))


def eval_reads(cfg: Config) -> Reads:
    """The eval section, and what the measurement runs on besides the export: the target, its chat template,
    the draft depth trained, the seed and the capture's chunking of long prompts."""
    return Reads(("eval", "target", "data.chat_template", "drafter.ttt_steps", "drafter.algorithm",
                  "drafter.block_size", "run.seed", "capture.chunk_tokens"))


def check_eval_sources(cfg: Config) -> None:
    """Before eval runs: eval.long_context_source exists when set (a tiny recipe's names its build command)."""
    from fledge.evaluation.long_context import check_long_source
    from fledge.testbed.hints import build_hint

    if cfg.eval.context_buckets and cfg.eval.long_context_source:
        check_long_source(cfg.eval.long_context_source, hint=build_hint(cfg.eval.long_context_source))


# ------------------------------------------------------------------------------------------ publish
def publish(ctx: StageContext) -> dict:
    """With export.push_to_hub: push the export and a model card of this run's own eval to the Hub (rank 0;
    after eval, so the card carries what was measured). Without: nothing."""
    from fledge.pipeline.publish import publish_run

    if not ctx.cfg.export.push_to_hub:
        return {"pushed": False}
    return _on_main(ctx, lambda: publish_run(ctx.cfg, ctx.layout, ExportOutputs.of(ctx).drafter))


def publish_reads(cfg: Config) -> Reads:
    """Where to push, and what the card says besides the run's measurements (the target's config and the
    draft length, as export wrote them)."""
    return Reads((*_keys("export", PUBLISH_KEYS), "target", "eval.draft_tokens"), ("run.stages",))


# ------------------------------------------------------------------------------------------ helpers
def _on_main(ctx: StageContext, work: Callable[[], dict]) -> dict:
    """Run ``work`` on rank 0 and give every rank its outcome: the summary, or its user error re-raised as
    the run's refusal (one line, said once: rank 0 decided), so no rank waits at a collective for a rank 0
    that failed."""
    from fledge.user_errors import USER_ERRORS

    result: dict[str, Any] = {}
    error = None
    if ctx.world.is_main:
        try:
            result = {"summary": work()}
        except USER_ERRORS as e:
            result, error = {"error": str(e)}, e
    result = broadcast_object(result)
    if "error" in result:
        raise Refused(result["error"]) from error  # rank 0's own, for FLEDGE_DEBUG=1's traceback
    return result["summary"]


def _reads_the_store(cfg: Config) -> bool:
    return cfg.capture.mode != "online"  # online training reads the target live: it needs prepare, not capture


PIPELINE: tuple[Stage, ...] = (
    Stage("prepare", prepare, prepare_reads, target_files=True, check=check_sources),
    Stage("capture", capture, capture_reads, upstream="prepare", target_files=True),
    Stage("train", train, train_reads, upstream="capture", needs_upstream=_reads_the_store, done=trained_enough),
    Stage("export", export, export_reads, upstream="train", rebuild=True, target_files=True),
    Stage("eval", evaluate, eval_reads, upstream="export", rebuild=True, check=check_eval_sources),
    Stage("publish", publish, publish_reads, upstream="eval", rebuild=True),
)
STAGES: dict[str, Stage] = {s.name: s for s in PIPELINE}
