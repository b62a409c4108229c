"""The train stage: TTT training of the drafter under DeepSpeed ZeRO, resumable exactly.

One optimizer step = ``grad_accum`` micro-batches on each of ``world`` ranks (with
``train.sequence_parallel=N``, on each of ``world / N`` groups of N ranks that split every row:
train/sequence_parallel.py). Batches come from a
global plan that does not depend on the world size (rank r takes global batches r, r+W, ...), so
2 ranks x 1 micro-batch and 1 rank x 2 micro-batches see the same data. Each checkpoint stores the
global batches consumed, and a resume on any world size and grad_accum continues at that batch
(train/checkpoint.py ``resume_plan``: ``train.max_steps`` counts optimizer steps of whatever size,
``train.epochs`` counts data). Randomness is re-seeded from (seed, step, rank) every step, so a resumed
run replays the uninterrupted one. Held-out eval reads the same global batches on every layout.

The step optimises the loss of one batch holding all its rows: L_k is the mean over step k's counted rows
of every micro-batch on every rank, not a mean of per-micro-batch means (train/losses
``step_denominators``). So each rank reads its ``grad_accum`` micro-batches of the step first (held on the
host, or on the device with ``capture.mode=online``), counts their rows, and one all-reduce of K integers
gives every rank the step's denominators before the first forward. The logged ``loss`` is that objective.

SIGTERM (Slurm's time limit or preemption) is taken at a step boundary: each rank reads its step's micro-batches,
and before the step's first collective every rank learns whether any rank was told to stop. If so, no rank runs the
step: its batches are given back (the checkpoint's data position is the step's start, so a resume reads them again),
the steps trained are checkpointed and the ranks exit 75 (so too after the last step, with its checkpoint). A rank
waiting for a streaming engine's batch gives the wait up at once (data/capture/stream.py ``StreamInterrupted``):
the engines get the job's SIGTERM too, and one started again would load for longer than the grace period. A
held-out evaluation, streamed or read from the store, is cut short so and skipped (every rank learns it before each
forward); the run checkpoints and exits there.

A non-finite loss skips its whole optimizer step, on every rank: every micro-batch still runs its
backward and DeepSpeed step (so DeepSpeed's accumulation boundary never moves), the non-finite one with
a NaN scale, and DeepSpeed's own check of the step's gradient norm, global over ranks, discards the
step's gradients and leaves the weights, optimizer state and lr schedule as they were.
"""

from __future__ import annotations

import logging
import time

import torch

from fledge import signals
from fledge.conf.schema import Config
from fledge.data.capture.sources import feature_sources
from fledge.data.capture.stream import EngineFeatureSource, StreamInterrupted
from fledge.distributed import World, all_reduce_sum, any_rank, sequence_groups
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.models.drafter_checkpoint import META, DrafterCheckpoint
from fledge.progress import progress
from fledge.stage_context import StageContext
from fledge.train import checkpoint
from fledge.train.deepspeed_setup import build_engine, gradient_divisor, use_bf16
from fledge.train.metrics import MetricsLog, RatioMeter
from fledge.train.sequence_parallel import SequenceParallel, check_heads
from fledge.train.ttt_model import TTTModel, build_ttt_model

log = logging.getLogger(__name__)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpoint written, re-run the same command to resume


class Preempted(Exception):
    """SIGTERM arrived (e.g. Slurm preemption); a checkpoint was written at ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted: checkpoint written at step {step}; re-run the same command to resume")
        self.step = step


def run_training(ctx: StageContext) -> dict:
    """The train stage: build the TTT model and DeepSpeed engine, resume, train, checkpoint, evaluate."""
    with signals.held():  # SIGTERM (and Ctrl-C's SIGINT, a closed terminal's SIGHUP) is taken at a step boundary
        return _train(ctx)


def _train(ctx: StageContext) -> dict:
    cfg, world = ctx.cfg, ctx.world
    groups = sequence_groups(world, cfg.train.sequence_parallel)  # a bad size fails before any weight is read
    model = build_ttt_model(cfg, ctx.layout.prepare.vocab, world.device)
    spec = model.drafter.spec
    check_heads(groups.size, spec.num_key_value_heads, spec.num_attention_heads)
    seq = SequenceParallel(groups, cfg.drafter.ttt_steps) if groups.size > 1 else None
    dtype = torch.bfloat16 if use_bf16(cfg, world) else torch.float32
    if cfg.deepspeed.zero_stage == 0 and dtype == torch.float32:
        # Measured (DeepSpeed 0.19.8): ZeRO 1-3, and bf16 at stage 0, skip a step whose gradient norm is
        # not finite; fp32 at stage 0 hands the gradients to the optimizer as they are.
        raise ValueError("deepspeed.zero_stage=0 in fp32 steps the optimizer on non-finite gradients, so a "
                         "NaN batch would corrupt the drafter instead of being skipped; use "
                         "deepspeed.zero_stage=1 (or deepspeed.bf16=true)")
    # a sequence-parallel group is one data-parallel rank: the global batch plan is the same as without it
    train_data, eval_data = feature_sources(cfg.target, cfg.capture, cfg.train, cfg.aux_layer_ids(), cfg.run.seed,
                                           ctx.layout, ctx.world, dtype, groups.dp_rank, groups.dp_size)
    per_step = cfg.train.grad_accum * groups.dp_size  # global batches per optimizer step

    paths = ctx.layout.train
    ckpt_dir = paths.checkpoints
    tag = checkpoint.latest_tag(ckpt_dir)
    state = checkpoint.trainer_state(ckpt_dir, tag) if tag else {"step": 0, "best_al": None, "best_step": None}
    plan = checkpoint.resume_plan(state, cfg, per_step, train_data.global_batches_per_epoch)
    total = plan.total
    # the resumed checkpoint's weights are the run's last until it saves another (it may have nothing left to do)
    last_drafter_dir = checkpoint.drafter_dir(ckpt_dir, tag) if tag else None
    universal = bool(tag) and state["world_size"] != world.world_size
    if universal:
        tag = checkpoint.to_universal(ckpt_dir, tag, world)
    engine, _, scheduler = build_engine(model, cfg, world, total, plan.decay_from, load_universal=universal)
    model.cast_teacher(dtype)
    if tag:
        path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if path is None:
            raise ValueError(f"could not load checkpoint {ckpt_dir / tag}; delete {ckpt_dir} to start over")
        log.info("resumed from %s at step %d, global batch %d (saved by %d ranks)", tag, plan.step, plan.batches,
                 state["world_size"])
        if plan.note and world.is_main:
            log.warning(plan.note)
        if world.is_main:
            _best_follows_state(ckpt_dir, state, paths.best)
    step = plan.step
    # the run ends after total - step more steps of per_step global batches (an engine streams exactly those)
    train_data.seek(plan.batches, end=plan.batches + (total - step) * per_step)
    was = state.get("batches_per_step")
    if tag and was and was != per_step and world.is_main:
        log.warning("train: the optimizer step now takes %d global batches (train.grad_accum=%d x %d data-parallel "
                    "ranks) where the checkpoint's took %d: the run goes on from global batch %d with steps of the "
                    "new size; set train.grad_accum to keep the old one", per_step, cfg.train.grad_accum,
                    groups.dp_size, was, plan.batches)
    divisor = gradient_divisor(engine)

    metrics_log = None
    if world.is_main:
        metrics_log = MetricsLog(paths.metrics, step, cfg.logging, cfg.run.name,
                                 {"recipe": cfg.recipe, "drafter": vars(cfg.drafter), "train": vars(cfg.train)})
    for source in (train_data, eval_data):  # a wait for a streaming engine's batch ends on SIGTERM
        if isinstance(source, EngineFeatureSource):
            source.stop_requested = signals.stopping
    saved = plan.step if tag else None  # the step of the newest checkpoint

    def save(position: int) -> None:
        """A checkpoint at ``step`` whose data position is global batch ``position``; every rank calls."""
        nonlocal last_drafter_dir, saved
        state.update(skipped=skipped, batches=position, batches_per_step=per_step,
                     schedule={"total": total, "count": scheduler.last_epoch, "decay_from": plan.decay_from})
        last_drafter_dir = checkpoint.save(engine, world, ckpt_dir, step,
                                           {k: v for k, v in state.items() if k != "best_pending"},
                                           drafter_ckpt, TTTModel.PREFIX, cfg.train.keep_last)
        if state.pop("best_pending", False) and world.is_main:
            checkpoint.promote_best(last_drafter_dir, paths.best)
        world.barrier()
        saved = step

    meter, tokens, nonfinite_run, skipped = RatioMeter(), 0, 0, int(state.get("skipped", 0))
    bar = progress(total=total, initial=step, desc="train", disable=not world.is_main)
    t_log = time.time()
    drafter_ckpt = checkpoint.drafter_checkpoint(cfg, model.drafter.spec)
    try:
        while step < total:
            torch.manual_seed(cfg.run.seed * 1_000_003 + step * world.world_size + world.rank)
            step_meter, step_tokens, positions, nonfinite = RatioMeter(), 0, [], []
            start = train_data.position
            try:
                micro = [train_data.next_batch() for _ in range(cfg.train.grad_accum)]
            except StreamInterrupted:
                micro = None
            if any_rank(micro is None or signals.stopping()):  # the step boundary: no rank runs this step
                if saved != step:
                    save(start)
                raise Preempted(step)
            micro = [(g, seq.split(b) if seq else b) for g, b in micro]  # this rank's rows, before the device
            # the step's loss is the mean over all its rows, on every rank (train/losses step_denominators)
            denominators = model.step_denominators([b for _, b in micro], divisor)
            for position, batch in micro:
                out = engine(batch.to(world.device, dtype), denominators)
                bad = ~torch.isfinite(out.loss.detach())
                # Skipping this backward would move DeepSpeed's accumulation boundary (the next micro-batch
                # would close this step); a NaN scale instead makes sure the step's gradient is non-finite
                # even where this loss's would not be, so DeepSpeed discards the whole step. x1 is exact.
                engine.backward(out.loss * torch.where(bad, float("nan"), 1.0))
                engine.step()
                # kept apart until the step is known to count. "loss": the mean over the step's grad_accum x
                # world micro-batch losses, which is the objective the step optimised (gradient_divisor)
                step_meter.add({**out.metrics, "loss": (out.loss.detach(), 1.0)})
                step_tokens += batch.num_tokens
                positions.append(position)
                nonfinite.append(bad)
            applied = engine.was_step_applied()  # the same on every rank: the gradient norm is global
            if any_rank(torch.stack(nonfinite)) and applied:
                raise RuntimeError(f"DeepSpeed applied step {step} although a loss was non-finite; this trainer "
                                   "relies on DeepSpeed skipping steps whose gradient norm is not finite")
            if applied:
                nonfinite_run = 0
                meter.add(step_meter.sums)
                tokens += step_tokens
            else:
                nonfinite_run += 1
                skipped += 1
                here = [g for g, b in zip(positions, nonfinite) if bool(b)]
                log.warning("step %d skipped (no update): %s", step,
                            f"non-finite loss at global batch {here}" if here else "non-finite loss or gradient")
                if nonfinite_run >= cfg.train.max_nonfinite:
                    # The user's settings or data, not a bug: a ValueError is one line and exit code 2.
                    raise ValueError(
                        f"{nonfinite_run} optimizer steps in a row skipped for non-finite losses or gradients (limit "
                        f"train.max_nonfinite={cfg.train.max_nonfinite}), the last at step {step} (global batches "
                        f"{positions} on rank {world.rank}): training diverged. Lower train.optim.lr and start the "
                        "stage over with run.force=[train]; if the loss was finite before, check the features of "
                        "those batches")
            step += 1
            bar.update(1)
            if step % cfg.train.log_every == 0 or step == total:
                values = meter.reduce()
                n_tok = float(all_reduce_sum(torch.tensor([float(tokens)]))[0])
                now = time.time()
                record = {"step": step, "lr": scheduler.get_last_lr()[0], "grad_norm": _grad_norm(engine),
                          "tokens_per_s": n_tok / max(1e-9, now - t_log), "skipped": skipped, **values,
                          "al_estimate": al_estimate(StepAccuracy.from_values(values, cfg.drafter.draft_steps()))}
                tokens, t_log = 0, now
                if metrics_log:
                    metrics_log.write(record)
                    bar.set_postfix(loss=f"{values.get('loss', float('nan')):.3f}",
                                    al=f"{record['al_estimate']:.2f}")
            is_eval = step % cfg.train.eval_every == 0 or step == total
            cut_short = False
            if is_eval:
                try:
                    ev = evaluate(engine, eval_data, cfg, world, dtype, seq)
                except StreamInterrupted:  # on every rank (evaluate agrees on it): this eval is skipped
                    cut_short = True
                    log.warning("step %d: SIGTERM during the held-out evaluation; it is skipped", step)
                else:
                    if metrics_log:
                        metrics_log.write({"step": step, **ev})
                    if state["best_al"] is None or ev["eval/al_estimate"] > state["best_al"]:
                        state.update(best_al=ev["eval/al_estimate"], best_step=step, best_pending=True)
            if step % cfg.train.save_every == 0 or step == total or cut_short or state.get("best_pending"):
                save(train_data.position)
            if cut_short:
                raise Preempted(step)
        if any_rank(signals.stopping()):  # during the last step: its checkpoint is written, the stages after it wait
            raise Preempted(step)
    finally:
        for source in (train_data, eval_data):  # an engine streaming states (data/capture/stream.py) ends here
            getattr(source, "close", lambda: None)()
        bar.close()
        if metrics_log:
            metrics_log.close()
    return {"steps": step, "last": str(last_drafter_dir),
            "best": str(paths.best if paths.best.exists() else last_drafter_dir),
            "best_step": state["best_step"], "best_al_estimate": state["best_al"], "skipped_steps": skipped,
            "global_batches": train_data.position, "global_batches_per_epoch": train_data.global_batches_per_epoch,
            "global_batches_per_step": per_step,
            **({"engine_wait_s": round(train_data.wait_s, 3), "engine_starts": train_data.engine_starts}
               if hasattr(train_data, "wait_s") else {})}


@torch.no_grad()
def evaluate(engine, data, cfg: Config, world: World, dtype: torch.dtype, seq=None) -> dict[str, float]:
    """Teacher-forced held-out metrics over ``train.eval_batches`` global batches, split over the
    data-parallel ranks (``data.eval_batches``), so the same on any world size (``seq``: the rank's
    ``SequenceParallel``, which splits each batch over its group)."""
    meter = RatioMeter()
    engine.eval()
    try:
        for batch, counts in _agreed(data.eval_batches(cfg.train.eval_batches)):
            metrics = engine((seq.split(batch) if seq else batch).to(world.device, dtype)).metrics
            if not counts:  # a filler forward: zeros under the same names, which reduce() all-reduces on every rank
                metrics = {k: (torch.zeros_like(num), torch.zeros_like(torch.as_tensor(den))) for k, (num, den) in
                           metrics.items()}
            meter.add(metrics)
    finally:
        engine.train()
    values = meter.reduce()
    values = {f"eval/{k}": v for k, v in values.items()}
    accuracy = StepAccuracy.from_values(values, cfg.drafter.draft_steps(), prefix="eval/")
    values["eval/al_estimate"] = al_estimate(accuracy)
    return values


def _agreed(batches):
    """``batches``, each once every rank has its own (their forwards may be collectives: ZeRO-3 gathers); a
    StreamInterrupted on every rank as soon as any rank was told to stop (SIGTERM: a stream's read cut short, or a
    flag between batches of a store's, so a long held-out set never outlasts the grace period). Every rank reads as
    many held-out batches (padded), so all of them reach the end together."""
    it = iter(batches)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except StreamInterrupted:
            item = None
        if any_rank(item is None or signals.stopping()):
            raise StreamInterrupted("SIGTERM during the held-out evaluation")
        yield item


def _best_follows_state(ckpt_dir, state: dict, best_dir) -> None:
    """best/ holds the drafter of the checkpoint's best step (rank 0, at a resume). A save that finds a new best
    writes the checkpoint, ``latest`` naming it, and only then copies its drafter to best/: a run killed between
    the two resumes with a state whose best is that step and a best/ that is still the one before (which export
    and the manifest's ``best`` would then serve as the best); the copy is made now, from that checkpoint."""
    step = state.get("best_step")
    src = checkpoint.drafter_dir(ckpt_dir, checkpoint.tag_for(step)) if step is not None else None
    if src is None or not src.is_dir():  # no best yet, or one promoted before a later checkpoint was saved
        return
    held = DrafterCheckpoint.read(best_dir).step if (best_dir / META).is_file() else None
    if held != step:
        log.warning("train: %s holds the drafter of step %s, the checkpoint's best is step %d (a run stopped between "
                    "the two): copying it there", best_dir, held, step)
        checkpoint.promote_best(src, best_dir)


def _grad_norm(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")
