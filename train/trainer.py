"""The train stage: TTT training of the drafter under DeepSpeed ZeRO, resumable exactly.

``run_training`` builds the TTT model (train/ttt_model.py) and this rank's feature sources (data/capture/sources.py,
each a ``FeatureSource``: data/features/source.py) from the stage's ``TrainInputs``, and hands them to a
:class:`Trainer`, whose ``fit`` resumes, steps, evaluates (train/held_out.py) and checkpoints (train/checkpoint.py).

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
waiting for a streaming engine's batch gives the wait up at once (``FeatureSource.stop_when``: ``StreamInterrupted``):
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
from fledge.data.capture.sources import feature_sources
from fledge.data.features.source import FeatureSource, StreamInterrupted
from fledge.distributed import SequenceGroups, World, all_reduce_sum, any_rank, sequence_groups
from fledge.models.alignment import StepAccuracy, al_estimate
from fledge.progress import progress
from fledge.run_layout import RunLayout, TrainDir
from fledge.stage_inputs import TrainInputs
from fledge.train import checkpoint
from fledge.train.deepspeed_setup import build_engine, gradient_divisor, training_dtype
from fledge.train.held_out import held_out_metrics
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


def run_training(inputs: TrainInputs, world: World, layout: RunLayout) -> dict:
    """The train stage: build the TTT model and this rank's feature sources, then :meth:`Trainer.fit`; the stage's
    outputs (its manifest's, which pipeline/stages.py ``TrainOutputs`` and ``trained_enough`` read)."""
    with signals.held():  # SIGTERM (and Ctrl-C's SIGINT, a closed terminal's SIGHUP) is taken at a step boundary
        groups = sequence_groups(world, inputs.train.sequence_parallel)  # a bad size fails before any weight is read
        model = build_ttt_model(inputs, layout.prepare.vocab, world.device)
        spec = model.drafter.spec
        check_heads(groups.size, spec.num_key_value_heads, spec.num_attention_heads)
        dtype = training_dtype(inputs.deepspeed, world)
        # a sequence-parallel group is one data-parallel rank: the global batch plan is the same as without it
        source, held_out = feature_sources(inputs.target, inputs.capture, inputs.train, list(inputs.aux_layer_ids),
                                           inputs.seed, layout, world, dtype, groups.dp_rank, groups.dp_size)
        return Trainer(inputs, model, source, held_out, world, layout.train, groups, dtype).fit()


class Trainer:
    """Trains ``model`` under DeepSpeed on ``source``'s batches (``held_out``'s for evaluation), resumable exactly
    from the checkpoints under ``paths`` (the module docstring says how). ``fit`` runs the stage: ``resume``, then
    ``step`` after ``step`` with its logs, ``evaluate`` and ``save`` at the run's cadence."""

    def __init__(self, inputs: TrainInputs, model: TTTModel, source: FeatureSource, held_out: FeatureSource,
                 world: World, paths: TrainDir, groups: SequenceGroups, dtype: torch.dtype) -> None:
        self.inputs, self.model, self.source, self.held_out = inputs, model, source, held_out
        self.world, self.paths, self.groups, self.dtype = world, paths, groups, dtype
        self.seq = SequenceParallel(groups, inputs.drafter.ttt_steps) if groups.size > 1 else None
        self.per_step = inputs.train.grad_accum * groups.dp_size  # global batches per optimizer step
        self.drafter_ckpt = checkpoint.drafter_checkpoint(inputs, model.drafter.spec)
        self.state: dict = {}  # trainer.json's (train/checkpoint.py): data position, best so far, skipped steps
        self.plan: checkpoint.ResumePlan | None = None
        self.engine = self.scheduler = None
        self.steps_done = self.total = 0  # optimizer steps done; the step the run ends at
        self.saved: int | None = None  # the step of the newest checkpoint
        self.last_drafter_dir = None  # its drafter checkpoint
        self.divisor = 1.0  # micro-batch losses per optimizer step (deepspeed_setup.gradient_divisor)
        self.meter, self.tokens, self.t_log = RatioMeter(), 0, time.time()  # since the last metrics line
        self.nonfinite_run = self.skipped = 0  # skipped steps: in a row, in all
        self.metrics_log: MetricsLog | None = None
        self.bar = None

    # ------------------------------------------------------------------------------------------ the run
    def fit(self) -> dict:
        """Resume, then train to the run's end; the stage's outputs. ``Preempted`` (a checkpoint written) when a
        stop signal arrives; the sources are closed however the run ends."""
        try:
            self.resume()
            self._start()
            while self.steps_done < self.total:
                self.step()
                self._after_step()
            if any_rank(signals.stopping()):  # during the last step: its checkpoint is written, the stages after wait
                raise Preempted(self.steps_done)
        finally:
            self._close()
        return self.outputs()

    def resume(self) -> None:
        """Build the DeepSpeed engine at the newest checkpoint, on any world size and grad_accum (train/checkpoint.py
        ``resume_plan``; DeepSpeed's universal format when the world changed), or fresh; seek the source to the
        checkpoint's data position."""
        ckpt_dir, world = self.paths.checkpoints, self.world
        tag = checkpoint.latest_tag(ckpt_dir)
        if tag:
            checkpoint.same_drafter(ckpt_dir, tag, self.model.drafter.spec)
        self.state = checkpoint.trainer_state(ckpt_dir, tag) if tag else {"step": 0, "best_al": None, "best_step": None}
        plan = self.plan = checkpoint.resume_plan(self.state, self.inputs.train, self.per_step,
                                                  self.source.global_batches_per_epoch)
        self.steps_done, self.total = plan.step, plan.total
        # the resumed checkpoint's weights are the run's last until it saves another (it may have nothing left to do)
        self.last_drafter_dir = checkpoint.drafter_dir(ckpt_dir, tag) if tag else None
        universal = bool(tag) and self.state["world_size"] != world.world_size
        if universal:
            tag = checkpoint.to_universal(ckpt_dir, tag, world, self.inputs.train.optim)
        self.engine, _, self.scheduler = build_engine(self.model, self.inputs, world, plan.total, plan.decay_from,
                                                      load_universal=universal)
        self.model.cast_teacher(self.dtype)
        if tag:
            self._load(tag)
        # the run ends after total - step more steps of per_step global batches (an engine streams exactly those)
        self.source.seek(plan.batches, end=plan.batches + (plan.total - plan.step) * self.per_step)
        self._warn_step_size(bool(tag))
        self.divisor = gradient_divisor(self.engine)
        self.saved = plan.step if tag else None
        self.skipped = int(self.state.get("skipped", 0))

    def step(self) -> None:
        """One optimizer step: ``train.grad_accum`` micro-batches on every data-parallel rank, the loss the mean over
        all their rows (train/losses ``step_denominators``); a non-finite loss skips the step on every rank (its
        NaN scale makes DeepSpeed discard the step's gradients). ``Preempted`` at the step boundary on SIGTERM."""
        w, engine = self.world, self.engine
        torch.manual_seed(self.inputs.seed * 1_000_003 + self.steps_done * w.world_size + w.rank)
        micro = [(g, self.seq.split(b) if self.seq else b) for g, b in self._read_step()]  # this rank's rows
        denominators = self.model.step_denominators([b for _, b in micro], self.divisor)
        meter, tokens, nonfinite = RatioMeter(), 0, []
        for _, batch in micro:
            out = engine(batch.to(w.device, self.dtype), denominators)
            bad = ~torch.isfinite(out.loss.detach())
            # Skipping this backward would move DeepSpeed's accumulation boundary (the next micro-batch
            # would close this step); a NaN scale instead makes sure the step's gradient is non-finite
            # even where this loss's would not be, so DeepSpeed discards the whole step. x1 is exact.
            engine.backward(out.loss * torch.where(bad, float("nan"), 1.0))
            engine.step()
            # kept apart until the step is known to count. "loss": the mean over the step's grad_accum x
            # world micro-batch losses, which is the objective the step optimised (gradient_divisor)
            meter.add({**out.metrics, "loss": (out.loss.detach(), 1.0)})
            tokens += batch.num_tokens
            nonfinite.append(bad)
        self._count_step(meter, tokens, [g for g, _ in micro], nonfinite)
        self.steps_done += 1
        self.bar.update(1)

    def evaluate(self) -> dict[str, float] | None:
        """The held-out metrics at this step (train/held_out.py), logged; a better AL estimate becomes the best, which
        the next :meth:`save` copies to best/. None when SIGTERM cut the evaluation short (on every rank: skipped)."""
        t = self.inputs
        try:
            ev = held_out_metrics(self.engine, self.held_out, t.train.eval_batches, t.drafter.draft_steps(), self.world,
                                  self.dtype, self.seq)
        except StreamInterrupted:
            log.warning("step %d: SIGTERM during the held-out evaluation; it is skipped", self.steps_done)
            return None
        if self.metrics_log:
            self.metrics_log.write({"step": self.steps_done, **ev})
        if self.state["best_al"] is None or ev["eval/al_estimate"] > self.state["best_al"]:
            self.state.update(best_al=ev["eval/al_estimate"], best_step=self.steps_done, best_pending=True)
        return ev

    def save(self, position: int) -> None:
        """A checkpoint at this step whose data position is global batch ``position``, its drafter copied to best/
        when this step is the best so far; every rank calls."""
        schedule = {"total": self.total, "count": self.scheduler.last_epoch, "decay_from": self.plan.decay_from}
        self.state.update(skipped=self.skipped, batches=position, batches_per_step=self.per_step, schedule=schedule)
        self.last_drafter_dir = checkpoint.save(self.engine, self.world, self.paths.checkpoints, self.steps_done,
                                                {k: v for k, v in self.state.items() if k != "best_pending"},
                                                self.drafter_ckpt, TTTModel.PREFIX, self.inputs.train.keep_last)
        if self.state.pop("best_pending", False) and self.world.is_main:
            checkpoint.promote_best(self.last_drafter_dir, self.paths.best)
        self.world.barrier()
        self.saved = self.steps_done

    def outputs(self) -> dict:
        """The train stage's manifest outputs (pipeline/stages.py ``TrainOutputs`` and ``trained_enough`` read them),
        with what the source records of itself (a stream's engine waits and starts)."""
        last, best = self.last_drafter_dir, self.paths.best
        return {"steps": self.steps_done, "last": str(last), "best": str(best if best.exists() else last),
                "best_step": self.state["best_step"], "best_al_estimate": self.state["best_al"],
                "skipped_steps": self.skipped, "global_batches": self.source.position,
                "global_batches_per_epoch": self.source.global_batches_per_epoch,
                "global_batches_per_step": self.per_step, **self.source.stats()}

    # ------------------------------------------------------------------------------------------ its parts
    def _load(self, tag: str) -> None:
        """Load checkpoint ``tag`` into the engine; rank 0 says what the resume changed and puts best/ right."""
        ckpt_dir, plan = self.paths.checkpoints, self.plan
        path, _ = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if path is None:
            raise ValueError(f"could not load checkpoint {ckpt_dir / tag}; delete {ckpt_dir} to start over")
        log.info("resumed from %s at step %d, global batch %d (saved by %d ranks)", tag, plan.step, plan.batches,
                 self.state["world_size"])
        if self.world.is_main:
            if plan.note:
                log.warning(plan.note)
            checkpoint.best_follows_state(ckpt_dir, self.state, self.paths.best)

    def _warn_step_size(self, resumed: bool) -> None:
        was = self.state.get("batches_per_step")
        if resumed and was and was != self.per_step and self.world.is_main:
            log.warning("train: the optimizer step now takes %d global batches (train.grad_accum=%d x %d data-parallel "
                        "ranks) where the checkpoint's took %d: the run goes on from global batch %d with steps of the "
                        "new size; set train.grad_accum to keep the old one", self.per_step,
                        self.inputs.train.grad_accum, self.groups.dp_size, was, self.plan.batches)

    def _start(self) -> None:
        """The metrics log and progress bar from the resumed step; a wait for a streaming engine's batch ends on
        SIGTERM."""
        t = self.inputs
        if self.world.is_main:
            self.metrics_log = MetricsLog(self.paths.metrics, self.steps_done, t.logging, t.run_name,
                                          {"recipe": t.recipe, "drafter": vars(t.drafter), "train": vars(t.train)})
        for source in (self.source, self.held_out):
            source.stop_when(signals.stopping)
        self.bar = progress(total=self.total, initial=self.steps_done, desc="train", disable=not self.world.is_main)
        self.t_log = time.time()

    def _close(self) -> None:
        for source in (self.source, self.held_out):  # an engine streaming states (data/capture/stream.py) ends here
            source.close()
        if self.bar is not None:
            self.bar.close()
        if self.metrics_log:
            self.metrics_log.close()

    def _read_step(self) -> list:
        """This rank's micro-batches of the step, as (global batch, batch). The step boundary: when any rank was told
        to stop, no rank runs the step; the steps trained are checkpointed at the step's start and ``Preempted``."""
        start = self.source.position
        try:
            micro = [self.source.next_batch() for _ in range(self.inputs.train.grad_accum)]
        except StreamInterrupted:
            micro = None
        if any_rank(micro is None or signals.stopping()):
            if self.saved != self.steps_done:
                self.save(start)
            raise Preempted(self.steps_done)
        return micro

    def _count_step(self, meter: RatioMeter, tokens: int, positions: list[int], nonfinite: list) -> None:
        """Count the step just run: its metrics and tokens when DeepSpeed applied it, else a skipped step, and a
        ValueError once ``train.max_nonfinite`` were skipped in a row."""
        applied = self.engine.was_step_applied()  # the same on every rank: the gradient norm is global
        if any_rank(torch.stack(nonfinite)) and applied:
            raise RuntimeError(f"DeepSpeed applied step {self.steps_done} although a loss was non-finite; this trainer "
                               "relies on DeepSpeed skipping steps whose gradient norm is not finite")
        if applied:
            self.nonfinite_run = 0
            self.meter.add(meter.sums)
            self.tokens += tokens
            return
        self.nonfinite_run += 1
        self.skipped += 1
        here = [g for g, b in zip(positions, nonfinite) if bool(b)]
        log.warning("step %d skipped (no update): %s", self.steps_done,
                    f"non-finite loss at global batch {here}" if here else "non-finite loss or gradient")
        limit = self.inputs.train.max_nonfinite
        if self.nonfinite_run >= limit:
            # The user's settings or data, not a bug: a ValueError is one line and exit code 2.
            raise ValueError(
                f"{self.nonfinite_run} optimizer steps in a row skipped for non-finite losses or gradients (limit "
                f"train.max_nonfinite={limit}), the last at step {self.steps_done} (global batches {positions} on "
                f"rank {self.world.rank}): training diverged. Lower train.optim.lr and start the stage over with "
                "run.force=[train]; if the loss was finite before, check the features of those batches")

    def _after_step(self) -> None:
        """The run's cadence after a step: the metrics line, the held-out evaluation, the checkpoint (also at a new
        best, and when SIGTERM cut the evaluation short: then ``Preempted``)."""
        t, step = self.inputs.train, self.steps_done
        last = step == self.total
        if step % t.log_every == 0 or last:
            self._log_metrics()
        cut_short = (step % t.eval_every == 0 or last) and self.evaluate() is None
        if step % t.save_every == 0 or last or cut_short or self.state.get("best_pending"):
            self.save(self.source.position)
        if cut_short:
            raise Preempted(step)

    def _log_metrics(self) -> None:
        """One metrics line over the steps since the last (all ranks reduce; rank 0 writes)."""
        values = self.meter.reduce()
        n_tok = float(all_reduce_sum(torch.tensor([float(self.tokens)]))[0])
        now = time.time()
        record = {"step": self.steps_done, "lr": self.scheduler.get_last_lr()[0], "grad_norm": _grad_norm(self.engine),
                  "tokens_per_s": n_tok / max(1e-9, now - self.t_log), "skipped": self.skipped, **values,
                  "al_estimate": al_estimate(StepAccuracy.from_values(values, self.inputs.drafter.draft_steps()))}
        self.tokens, self.t_log = 0, now
        if self.metrics_log:
            self.metrics_log.write(record)
            self.bar.set_postfix(loss=f"{values.get('loss', float('nan')):.3f}", al=f"{record['al_estimate']:.2f}")


def _grad_norm(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")
