"""torchrun entry (``-m tests.helpers.muon_entry OUT LAYOUT``) for tests/distributed/test_muon.py: ``train.optim.name=
muon`` under DeepSpeed (fp32, gloo) through the trainer's ``build_engine``, on the TTT loss of a tiny drafter. STEPS
optimizer steps of one fixed two-row batch (:func:`whole_batch`) on 2 ranks, a row each, under the ZeRO stage
LAYOUT names: ``ranks`` (ZeRO-2) or ``zero1``. After step RESUME_AT it checkpoints, and a fresh engine loads that
checkpoint and trains to STEPS again. Rank 0 writes OUT/weights.safetensors (the drafter after STEPS, uninterrupted,
and ``resumed.``-prefixed after the resume) and OUT/losses.json (the uninterrupted run's loss per step)."""

import json
import sys
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from fledge.conf import compose
from fledge.data.features.batch import FeatureBatch
from fledge.distributed import World
from fledge.pipeline.stages import train_inputs
from fledge.train.deepspeed_setup import build_engine, gradient_divisor
from fledge.train.losses import SoftCrossEntropy
from fledge.train.ttt_model import TTTModel
from tests.helpers.models import FLAGS, make_drafter, packed_batch

STEPS, RESUME_AT = 4, 2
LAYOUTS = {"ranks": 2, "zero1": 1}  # layout -> ZeRO stage
OPTIM = ["train.optim.name=muon", "train.optim.lr=2e-2", "train.optim.warmup_steps=1", "train.optim.schedule=linear",
         "train.optim.grad_clip=0"]  # no clip: DeepSpeed computes its norm in fp64, the loop below in fp32


def inputs(layout: str):
    """The train stage's inputs: recipe=tiny with Muon under the layout's ZeRO stage, a row per rank and step."""
    return train_inputs(compose(["recipe=tiny", *OPTIM, "train.micro_batch_size=1",
                                 f"deepspeed.zero_stage={LAYOUTS[layout]}"]))


@contextmanager
def one_thread():
    """Torch on one CPU thread while it lasts: Muon's bf16 Newton-Schulz matmuls of these small matrices, on a CPU
    without native bf16, take milliseconds on one thread and up to a third of a second each on two of a busy 2-core
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def whole_batch() -> FeatureBatch:
    return packed_batch()


def tiny_model() -> TTTModel:
    """EAGLE-3.1's drafter of the test target's shape (hidden 32, draft vocab 40) and a teacher head, seeded."""
    drafter = make_drafter(seed=7, **FLAGS["eagle31"]).train()
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    return TTTModel(drafter, head, SoftCrossEntropy(steps=3, step_weight=0.8, chunk_size=7))


def rows(batch: FeatureBatch) -> list[FeatureBatch]:
    return [FeatureBatch(**{f.name: getattr(batch, f.name)[r:r + 1] for f in fields(batch)}) for r in (0, 1)]


def train(engine, model: TTTModel, micro: list[FeatureBatch], steps: range) -> list[float]:
    """``steps`` optimizer steps over ``micro`` (this rank's micro-batches); the loss of each, summed over ranks."""
    losses = []
    for _ in steps:
        denominators = model.step_denominators(micro, gradient_divisor(engine))
        total = torch.zeros(1)
        for batch in micro:
            loss = engine(batch, denominators).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def main() -> None:
    out, layout = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert size == 2, size
    world, ins = World(rank, size, rank, torch.device("cpu")), inputs(layout)
    micro = [rows(whole_batch())[rank]]
    model = tiny_model()
    engine, _, _ = build_engine(model, ins, world, STEPS)
    losses = train(engine, model, micro, range(RESUME_AT))
    engine.save_checkpoint(str(out / "ckpt"), tag="step_2", client_state={"universal_checkpoint_info": {}})
    losses += train(engine, model, micro, range(RESUME_AT, STEPS))
    weights = {k: v.detach().clone() for k, v in engine.module.drafter.state_dict().items()}
    fresh = tiny_model()
    engine, _, _ = build_engine(fresh, ins, world, STEPS)
    engine.load_checkpoint(str(out / "ckpt"), tag="step_2")
    train(engine, fresh, micro, range(RESUME_AT, STEPS))
    weights |= {f"resumed.{k}": v.detach().clone() for k, v in engine.module.drafter.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
        (out / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
