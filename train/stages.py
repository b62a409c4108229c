"""The six pipeline stages, each an ordinary function of a typed :class:`StageContext`.

A stage here is glue only: it reads what it needs from the context (config, world, run and stage
directories, upstream manifests), decides which ranks work, and calls the library that owns the work
(``fledge.data.prepare``, ``fledge.data.capture``, the trainer, ``fledge.models.export``, the evaluator,
``fledge.models.hub``). The runner (train/runner.py) orders them, hashes their inputs and records their
manifests; ``STAGES`` tells it which outputs are rebuilt on a change (export, eval, publish) and when a
complete train stage is not done (a longer run asked).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from fledge.conf.schema import Config
from fledge.distributed import broadcast_object
from fledge.train.runner import Stage, StageContext

log = logging.getLogger(__name__)


def prepare(ctx: StageContext) -> dict:
    """Tokenize the chat data with assistant-only masks and build the draft vocab (rank 0 works)."""
    from fledge.data.prepare import prepare as build

    cfg = ctx.cfg
    try:
        if not ctx.world.is_main:
            return {}
        return build(cfg.data, cfg.target, cfg.drafter.draft_vocab_size, cfg.run.seed, Path(ctx.stage_dir))
    finally:
        ctx.world.barrier()


def capture(ctx: StageContext) -> dict:
    """Capture the target's states for every prepared split into the feature store (all ranks)."""
    from fledge.data.capture import capture as run_capture

    cfg, prep = ctx.cfg, ctx.dir_of("prepare")
    if cfg.capture.mode == "offline" and not (prep / "train").exists():
        raise ValueError(f"{prep / 'train'} does not exist: run the prepare stage first (run.stages=[prepare,capture])")
    return run_capture(cfg.target, cfg.capture, cfg.aux_layer_ids(), ctx.world, prep, ctx.stage_dir,
                       ctx.upstream.get("prepare"), array_script=ctx.run_dir / "slurm" / "capture_array.sbatch")


def train(ctx: StageContext) -> dict:
    """Train the drafter with training-time test under DeepSpeed (all ranks)."""
    from fledge.train.trainer import run_training

    return run_training(ctx)


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


def export(ctx: StageContext) -> dict:
    """Checkpoint -> serving directory, linted (rank 0 works; its outcome, summary or error, reaches every
    rank so none waits on a failed one)."""
    return _on_main(ctx, lambda: _export(ctx.cfg, ctx.stage_dir / "drafter", checkpoint_of(ctx)))


def evaluate(ctx: StageContext) -> dict:
    """Measure the exported drafter: acceptance, baselines, drift (rank 0 works; its outcome, summary or
    error, reaches every rank, so a failed check, e.g. the engine's, does not leave the others waiting)."""
    from fledge.train.evaluate import evaluate_run

    return _on_main(ctx, lambda: evaluate_run(ctx.cfg, ctx.run_dir, ctx.stage_dir, drafter_dir_of(ctx),
                                              ctx.world.device))


def publish(ctx: StageContext) -> dict:
    """With export.push_to_hub: push the export and a model card of this run's own eval to the Hub (rank 0;
    after eval, so the card carries what was measured). Without: nothing."""
    if not ctx.cfg.export.push_to_hub:
        return {"pushed": False}
    return _on_main(ctx, lambda: _publish(ctx))


def check_publish(cfg: Config) -> None:
    """Before any stage runs: a run that will publish needs a token in HF_TOKEN and the Hub reachable."""
    if not (cfg.export.push_to_hub and "publish" in cfg.run.stages):
        return
    import huggingface_hub.constants

    if not os.environ.get("HF_TOKEN"):
        raise ValueError("export.push_to_hub=true: the publish stage reads the Hub token from HF_TOKEN only, and "
                         "it is not set; export HF_TOKEN (a write token), or set export.push_to_hub=false")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError("export.push_to_hub=true with HF_HUB_OFFLINE=1: publishing needs the Hub; unset "
                         "HF_HUB_OFFLINE for this command, or set export.push_to_hub=false")


def _publish(ctx: StageContext) -> dict:
    from fledge.models.export import load_target_config
    from fledge.models.hub import push_to_hub

    cfg = ctx.cfg
    check_publish(cfg)  # the token may have gone since the command started
    url = push_to_hub(drafter_dir_of(ctx), cfg.export.repo_id, private=cfg.export.private, run_dir=ctx.run_dir,
                      target_config=load_target_config(cfg.target), speculative_tokens=cfg.eval.draft_tokens,
                      token=os.environ["HF_TOKEN"])
    return {"pushed": True, "repo_id": cfg.export.repo_id, "private": cfg.export.private, "hub_url": url}


def _on_main(ctx: StageContext, work: Callable[[], dict]) -> dict:
    """Run ``work`` on rank 0 and give every rank its outcome: the summary, or its user error re-raised, so
    no rank waits at a collective for a rank 0 that failed."""
    result: dict[str, Any] = {}
    if ctx.world.is_main:
        try:
            result = {"summary": work()}
        except ValueError as e:
            result = {"error": str(e)}
    result = broadcast_object(result)
    if "error" in result:
        raise ValueError(result["error"])
    return result["summary"]


def _export(cfg: Config, out: Path, ckpt: Path) -> dict:
    from fledge.models.export import export_checkpoint, load_target_config
    from fledge.models.lint import format_findings, lint_drafter

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


STAGES: dict[str, Stage] = {
    "prepare": Stage(prepare), "capture": Stage(capture), "train": Stage(train, done=trained_enough),
    "export": Stage(export, rebuild=True), "eval": Stage(evaluate, rebuild=True),
    "publish": Stage(publish, rebuild=True)}


def checkpoint_of(ctx: StageContext) -> Path:
    """export.checkpoint = best | last | a path -> the checkpoint directory."""
    which = ctx.cfg.export.checkpoint
    if which in ("best", "last"):
        outputs = (ctx.upstream.get("train") or {}).get("outputs") or {}
        path = outputs.get(which) or (outputs.get("last") if which == "best" else None)
        if not path:
            raise ValueError(f"export.checkpoint={which}: the train stage's manifest names no such checkpoint")
    else:
        path = which
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (ctx.run_dir / p).exists():
        p = ctx.run_dir / p
    if not p.is_dir():
        raise ValueError(f"export.checkpoint={which}: {p} is not a directory")
    return p


def drafter_dir_of(ctx: StageContext) -> Path:
    """The exported drafter directory named by the export stage's manifest."""
    outputs = (ctx.upstream.get("export") or {}).get("outputs") or {}
    path = outputs.get("drafter") or outputs.get("path")
    if not path:
        raise ValueError("eval: the export stage's manifest names no drafter directory; run the export stage "
                         "(run.stages=[export,eval])")
    return Path(path)
