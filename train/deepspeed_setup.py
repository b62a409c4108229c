"""DeepSpeed engine from the train stage's inputs: ZeRO stage, offload, precision, the optimizer
(train/optimizers.py), lr schedule.

Batch sizes come from ``inputs.train`` only (each value lives once; no "auto", which only the
Hugging Face integration resolves). bf16 on CUDA, fp32 on CPU unless ``deepspeed.bf16=true`` asks for it
on a CPU with native bf16 (models/precision.py decides; elsewhere it falls back to fp32 with a warning).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fledge.conf.schema import DeepSpeedConfig, OptimConfig
from fledge.distributed import World
from fledge.models.precision import compute_dtype
from fledge.stage_inputs import TrainInputs
from fledge.train.optimizers import build_optimizer

log = logging.getLogger(__name__)


def use_bf16(ds: DeepSpeedConfig, world: World) -> bool:
    """Whether DeepSpeed trains in bf16 (and the batches are cast to it): ``deepspeed.bf16=auto`` means on
    CUDA only; ``true`` on a CPU without native bf16 means fp32, with a warning naming the key (emulated
    bf16 there is an order of magnitude slower than fp32)."""
    mode = str(ds.bf16).lower()
    if mode == "auto":
        return world.device.type == "cuda"
    if mode == "true":
        return compute_dtype(torch.bfloat16, world.device, "deepspeed.bf16=true") == torch.bfloat16
    if mode == "false":
        return False
    raise ValueError(f"deepspeed.bf16={ds.bf16!r}: expected auto | true | false")


def training_dtype(ds: DeepSpeedConfig, world: World) -> torch.dtype:
    """The dtype the drafter trains in and its batches are cast to (:func:`use_bf16`); ValueError for a setting
    that would step the optimizer on a NaN batch's gradients."""
    dtype = torch.bfloat16 if use_bf16(ds, world) else torch.float32
    if ds.zero_stage == 0 and dtype == torch.float32:
        # Measured (DeepSpeed 0.19.8): ZeRO 1-3, and bf16 at stage 0, skip a step whose gradient norm is
        # not finite; fp32 at stage 0 hands the gradients to the optimizer as they are.
        raise ValueError("deepspeed.zero_stage=0 in fp32 steps the optimizer on non-finite gradients, so a "
                         "NaN batch would corrupt the drafter instead of being skipped; use "
                         "deepspeed.zero_stage=1 (or deepspeed.bf16=true)")
    return dtype


def deepspeed_config(inputs: TrainInputs, world: World, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed json, built from the train stage's inputs; ``deepspeed.extra`` is merged last."""
    t, ds = inputs.train, inputs.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        if ds.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": world.device.type == "cuda"}
    if ds.offload_param:
        if ds.zero_stage != 3:
            raise ValueError("deepspeed.offload_param=true needs deepspeed.zero_stage=3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": world.device.type == "cuda"}
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # we gather ourselves (checkpoint.py)
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world.world_size,
        "gradient_clipping": t.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": use_bf16(ds, world)},
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if t.optim.name == "muon":  # a client optimizer DeepSpeed does not list (train/optimizers.py MuonAdamW)
        conf["zero_allow_untested_optimizer"] = True
    if load_universal:
        conf["checkpoint"] = {"load_universal": True}
    return _merge(conf, dict(ds.extra))


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def lr_lambda(o: OptimConfig, total_steps: int, decay_from: tuple[int, float] | None = None):
    """Linear warmup, then cosine / linear decay to ``min_lr_ratio`` (or constant), as a function of the
    scheduler's step (``o``: ``train.optim``). ``decay_from``: see :func:`decay_progress`."""
    warm = max(0, o.warmup_steps)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if o.schedule == "constant" or total_steps <= warm:
            return 1.0
        progress = decay_progress(o, total_steps, step, decay_from)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay

    return f


def gradient_divisor(engine) -> float:
    """How many micro-batch losses the gradient DeepSpeed hands its optimizer is the mean of: its
    ``backward`` divides each loss by ``gradient_accumulation_steps`` and ZeRO divides the all-reduced
    gradients by the data-parallel world (``dp_world_size`` over its own sequence-parallel size, 1 here:
    Fledge's sequence parallelism, train/sequence_parallel.py, keeps every rank in DeepSpeed's data-parallel
    group). So grad_accum x world size; read from the engine (DeepSpeed 0.19.8, runtime/engine.py
    ``backward``, runtime/zero/stage_1_and_2.py and stage3.py) rather than from the config."""
    return engine.gradient_accumulation_steps() * engine.dp_world_size / engine.sequence_parallel_size


def decay_progress(o: OptimConfig, total_steps: int, step: int, decay_from: tuple[int, float] | None = None) -> float:
    """The fraction of the lr decay done at scheduler step ``step`` (1 at ``total_steps``). The decay runs
    from the end of warmup, or, with ``decay_from=(s, p)``, from fraction p at step s: a resume whose new
    step size moved the run's end (train/checkpoint.py ``resume_plan``) goes on from the lr it had."""
    start, done = decay_from or (max(0, o.warmup_steps), 0.0)
    return min(1.0, done + (1 - done) * (step - start) / max(1, total_steps - start))


def build_engine(model: torch.nn.Module, inputs: TrainInputs, world: World, total_steps: int,
                 decay_from: tuple[int, float] | None = None, load_universal: bool = False):
    """Wrap ``model`` (whose trainable parameters are the drafter's) in a DeepSpeed engine; the lr schedule
    ends at ``total_steps`` (``decay_from``: see :func:`decay_progress`)."""
    import deepspeed

    o = inputs.train.optim
    optimizer = build_optimizer(model, o, offload=inputs.deepspeed.offload_optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, total_steps, decay_from))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(inputs, world, load_universal),
        dist_init_required=False,
    )
    return engine, optimizer, scheduler
