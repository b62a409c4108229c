"""The pipeline, defined once: one :class:`~fledge.pipeline.runner.Stage` record per stage in :data:`PIPELINE`.

A record says everything the runner needs (pipeline/runner.py): the stage's work, the stage it reads, how its
inputs are built from the config (``<stage>_inputs(cfg)``: the stage's dataclass of fledge/stage_inputs.py, whose
fields say which are hashed), whether a changed input rebuilds it or stops the run, when a complete stage has more
to do, and what must hold before it runs. The schema's list of stage names (conf/schema.py ``STAGES``, which cannot
import this module) is held to these records by tests/unit/pipeline/test_stages.py. Adding a stage is one record
here, its inputs' dataclass there and its name in the schema.

A stage function is glue only: it reads what it needs from its context (its inputs, world, the run's layout,
upstream manifests), decides which ranks work, and hands the library that owns the work its inputs (or their
fields) and the paths it reads and writes (fledge/run_layout.py names them): data/prepare, data/capture, the
trainer, serving/export.py, evaluation/evaluate.py, pipeline/publish.py. No library is handed the whole config.
Each stage function imports that library when it runs, so a command loads only the libraries of the stages it
runs (planning the others reads their manifests).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fledge.conf.schema import Config
from fledge.distributed import broadcast_object
from fledge.pipeline.runner import Refused, Stage, StageContext
from fledge.stage_inputs import (
    CaptureInputs,
    EvalInputs,
    ExportInputs,
    PrepareInputs,
    PublishInputs,
    TrainInputs,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ prepare
def prepare(ctx: StageContext[PrepareInputs]) -> dict:
    """Tokenize the chat data with assistant-only masks and build the draft vocab (rank 0 works; its outcome,
    summary or error, reaches every rank, as export's does)."""
    from fledge.data.prepare.build import prepare as build

    i = ctx.inputs
    return _on_main(ctx, lambda: build(i.data, i.target, i.draft_vocab_size, i.seed, ctx.layout.prepare))


def prepare_inputs(cfg: Config) -> PrepareInputs:
    """What the prepare stage reads of ``cfg`` (and hashes: :class:`PrepareInputs`)."""
    return PrepareInputs(cfg.data, cfg.target, cfg.drafter.draft_vocab_size, cfg.run.seed)


def check_sources(inputs: PrepareInputs) -> None:
    """Before prepare runs: every local data source exists (a tiny recipe's names its build command)."""
    from fledge.data.prepare.sources import check_source
    from fledge.testbed.hints import build_hint

    for src in [*inputs.data.sources, *inputs.data.eval_sources]:
        check_source(src.path, build_hint(src.path))


# ------------------------------------------------------------------------------------------ capture
def capture(ctx: StageContext[CaptureInputs]) -> dict:
    """Capture the target's states for every prepared split into the feature store (all ranks)."""
    from fledge.data.capture.offline import capture as run_capture

    i, prep = ctx.inputs, ctx.layout.prepare
    if i.capture.mode == "offline" and not prep.split("train").exists():
        raise ValueError(f"{prep.split('train')} does not exist: run the prepare stage first "
                         "(run.stages=[prepare,capture])")
    return run_capture(i.target, i.capture, i.aux_layer_ids, ctx.world, prep, ctx.layout.capture,
                       ctx.upstream.get("prepare"), array_script=ctx.layout.slurm_script("capture_array"))


def capture_inputs(cfg: Config) -> CaptureInputs:
    """What the capture stage reads of ``cfg`` (and hashes: :class:`CaptureInputs`)."""
    return CaptureInputs(cfg.target, cfg.capture, tuple(cfg.aux_layer_ids()))


# ------------------------------------------------------------------------------------------ train
def train(ctx: StageContext[TrainInputs]) -> dict:
    """Train the drafter with training-time test under DeepSpeed (all ranks)."""
    from fledge.train.trainer import run_training

    return run_training(_init_from_checkpoint(ctx), ctx.world, ctx.layout)


def _init_from_checkpoint(ctx: StageContext[TrainInputs]) -> TrainInputs:
    """The train stage's inputs with ``drafter.init_from`` naming a drafter checkpoint. A published or exported
    drafter (a serving directory: the trainer reads no serving format) is read through serving/export.py once,
    on rank 0, into ``train/init_from`` and the trainer starts from that; the hash keeps the path the user gave."""
    from fledge.models.drafter_checkpoint import META, DrafterCheckpoint

    inputs = ctx.inputs
    src = Path(inputs.drafter.init_from or "")
    if not inputs.drafter.init_from or (src / META).is_file() or not (src / "config.json").is_file():
        return inputs  # a checkpoint, or nothing the trainer will not refuse in its own words
    out = ctx.layout.train.root / "init_from"

    def convert() -> dict:
        from fledge.serving.export import load_drafter, spec_from_export

        spec = spec_from_export(src)
        drafter = load_drafter(src, target=inputs.target.name_or_path, spec=spec)
        DrafterCheckpoint(spec).write(out, drafter.state_dict())
        log.info("train: drafter.init_from=%s is an export; read into the drafter checkpoint %s", src, out)
        return {}

    _on_main(ctx, convert)  # every rank waits for it; a refusal reaches all
    drafter = dataclasses.replace(inputs.drafter, init_from=str(out))
    return dataclasses.replace(inputs, drafter=drafter)


def train_inputs(cfg: Config) -> TrainInputs:
    """What the train stage reads of ``cfg`` (and hashes: :class:`TrainInputs`)."""
    return TrainInputs(cfg.drafter, cfg.train, cfg.deepspeed, cfg.target, tuple(cfg.aux_layer_ids()), cfg.run.seed,
                       cfg.capture, cfg.logging, cfg.run.name, cfg.recipe)


def trained_enough(manifest: dict, inputs: TrainInputs) -> bool:
    """Whether a complete train stage reached the steps ``inputs`` ask for. More asked: False, and the runner
    runs it again, training on from its last checkpoint (export, eval and publish then rebuild on it).
    Fewer asked than trained: a ValueError, since a run does not train backwards."""
    from fledge.train.checkpoint import planned_steps

    out = manifest.get("outputs") or {}
    done, t = int(out.get("steps", 0)), inputs.train
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
def export(ctx: StageContext[ExportInputs]) -> dict:
    """Checkpoint -> serving directory, linted (rank 0 works; its outcome, summary or error, reaches every
    rank so none waits on a failed one)."""
    return _on_main(ctx, lambda: _export(ctx.inputs, ctx.layout.export.drafter, checkpoint_of(ctx)))


def export_inputs(cfg: Config) -> ExportInputs:
    """What the export stage reads of ``cfg`` besides the checkpoint (:class:`ExportInputs`)."""
    return ExportInputs(cfg.export, cfg.target, cfg.eval.draft_tokens)


def _export(inputs: ExportInputs, out: Path, ckpt: Path) -> dict:
    from fledge.serving.export import export_checkpoint, load_target_config
    from fledge.serving.lint import format_findings, lint_drafter

    target, ex = load_target_config(inputs.target), inputs.export
    export_checkpoint(ckpt, out, target, fmt=ex.format, max_shard_size=ex.max_shard_size,
                      target_name=inputs.target.name_or_path, speculative_tokens=inputs.draft_tokens)
    findings = lint_drafter(out, target) if ex.lint else []
    for f, line in zip(findings, format_findings(findings)):
        (log.info if f.level == "note" else log.warning)("lint: %s", line)
    n_err, n_warn = (sum(f.level == level for f in findings) for level in ("error", "warning"))
    summary: dict[str, Any] = {"drafter": str(out), "checkpoint": str(ckpt), "format": ex.format,
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


def checkpoint_of(ctx: StageContext[ExportInputs]) -> Path:
    """export.checkpoint = best | last | a path (relative: to the run directory) -> the checkpoint directory."""
    which = ctx.inputs.export.checkpoint
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
def evaluate(ctx: StageContext[EvalInputs]) -> dict:
    """Measure the exported drafter: acceptance, baselines, drift (rank 0 works; its outcome, summary or
    error, reaches every rank, so a failed check, e.g. the engine's, does not leave the others waiting)."""
    from fledge.evaluation.evaluate import evaluate_run

    trained = TrainOutputs.of(ctx)
    return _on_main(ctx, lambda: evaluate_run(ctx.inputs, ctx.layout.prepare, ctx.layout.eval,
                                              ExportOutputs.of(ctx).drafter, ctx.world.device,
                                              metrics_path=ctx.layout.train.metrics,
                                              train_al_estimate=trained.best_al_estimate if trained else None))


def eval_inputs(cfg: Config) -> EvalInputs:
    """What the eval stage reads of ``cfg`` besides the export (:class:`EvalInputs`)."""
    d = cfg.drafter
    return EvalInputs(cfg.eval, cfg.target, cfg.data.chat_template, d.ttt_steps, d.algorithm, d.block_size,
                      cfg.run.seed, cfg.capture.chunk_tokens)


def check_eval_sources(inputs: EvalInputs) -> None:
    """Before eval runs: eval.long_context_source exists when set (a tiny recipe's names its build command)."""
    from fledge.evaluation.long_context import check_long_source
    from fledge.testbed.hints import build_hint

    ev = inputs.eval
    if ev.context_buckets and ev.long_context_source:
        check_long_source(ev.long_context_source, hint=build_hint(ev.long_context_source))


# ------------------------------------------------------------------------------------------ publish
def publish(ctx: StageContext[PublishInputs]) -> dict:
    """With export.push_to_hub: push the export and a model card of this run's own eval to the Hub (rank 0;
    after eval, so the card carries what was measured). Without: nothing."""
    from fledge.pipeline.publish import publish_run

    if not ctx.inputs.export.push_to_hub:
        return {"pushed": False}
    return _on_main(ctx, lambda: publish_run(ctx.inputs, ctx.layout, ExportOutputs.of(ctx).drafter))


def publish_inputs(cfg: Config) -> PublishInputs:
    """What the publish stage reads of ``cfg`` besides the run's files (:class:`PublishInputs`)."""
    return PublishInputs(cfg.export, cfg.target, cfg.eval.draft_tokens, tuple(cfg.run.stages))


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


def _reads_the_store(inputs: TrainInputs) -> bool:
    return inputs.capture.mode != "online"  # online training reads the target live: it needs prepare, not capture


PIPELINE: tuple[Stage, ...] = (
    Stage("prepare", prepare, prepare_inputs, target_files=True, check=check_sources),
    Stage("capture", capture, capture_inputs, upstream="prepare", target_files=True),
    Stage("train", train, train_inputs, upstream="capture", needs_upstream=_reads_the_store, done=trained_enough),
    Stage("export", export, export_inputs, upstream="train", rebuild=True, target_files=True),
    Stage("eval", evaluate, eval_inputs, upstream="export", rebuild=True, check=check_eval_sources),
    Stage("publish", publish, publish_inputs, upstream="eval", rebuild=True),
)
STAGES: dict[str, Stage] = {s.name: s for s in PIPELINE}
