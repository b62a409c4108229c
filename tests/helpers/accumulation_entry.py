"""torchrun entry (``-m tests.helpers.accumulation_entry``) for tests/distributed/test_accumulation.py: one optimizer
step of the TTT loss under DeepSpeed (fp32, gloo, ZeRO stage argv[3]) on two micro-batches with very different numbers
of counted rows, laid out as argv[2]:
``whole`` (1 rank, one batch holding both), ``accum`` (1 rank, grad_accum=2) or ``ranks`` (2 ranks x 1). It
runs the trainer's step (train/trainer.py): the step's denominators first, then per micro-batch forward,
backward and DeepSpeed's step. Rank 0 writes the gradient the optimizer was handed (read before the step,
DeepSpeed's ``safe_get_full_grad``) to argv[1]/grads.safetensors and the logged loss to argv[1]/loss.json."""

import json
import sys
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from fledge.data.features.batch import FeatureBatch
from fledge.train.deepspeed_setup import gradient_divisor
from fledge.train.losses import SoftCrossEntropy
from fledge.train.ttt_model import TTTModel
from tests.helpers.models import FLAGS, make_drafter, packed_batch

STEPS = 3


def micro_batches() -> tuple[FeatureBatch, list[FeatureBatch]]:
    """A two-row batch and its rows as two micro-batches: row 0 with few counted rows, row 1 with many, and a
    draft vocab (below) that leaves some teacher argmaxes out."""
    whole = packed_batch()
    whole.target_argmax = torch.randint(0, 50, whole.target_argmax.shape, generator=torch.Generator().manual_seed(3))
    whole.loss_mask[0] &= torch.arange(whole.loss_mask.shape[1]) % 4 == 0
    whole.loss_mask[1] = True
    return whole, [FeatureBatch(**{f.name: getattr(whole, f.name)[r:r + 1] for f in fields(whole)}) for r in (0, 1)]


def main() -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    out, layout, stage = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole, parts = micro_batches()
    batches = {"whole": [whole], "accum": parts, "ranks": [parts[rank]]}[layout]
    drafter = make_drafter(seed=7, **FLAGS["eagle31"]).train()
    sel = torch.arange(50)[torch.arange(50) % 5 != 0]  # 40 draft ids; multiples of 5 are outside
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[sel] = True
    drafter.set_vocab(sel - torch.arange(40), t2d)
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    model = TTTModel(drafter, head, SoftCrossEntropy(steps=STEPS, step_weight=0.8, chunk_size=7))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": len(batches),
              "train_batch_size": len(batches) * world, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config, dist_init_required=False)
    divisor = gradient_divisor(engine)
    denominators = model.step_denominators(batches, divisor)
    losses = []
    for i, batch in enumerate(batches):
        res = engine(batch, denominators)
        engine.backward(res.loss)
        losses.append(res.loss.detach())
        if i == len(batches) - 1:  # the boundary: the reduced gradient the optimizer is about to step on
            params = dict(engine.module.named_parameters())
            grads = {n: safe_get_full_grad(params[n]).detach().clone().contiguous() for n in names}
        engine.step()
    # the logged loss, as the trainer reduces it: the mean of the step's micro-batch losses over all ranks
    logged = torch.stack(losses).sum().reshape(1)
    dist.all_reduce(logged)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(grads, str(out / "grads.safetensors"))
        (out / "loss.json").write_text(json.dumps({"loss": float(logged) / (len(batches) * world),
                                                   "divisor": divisor, "denominators": denominators.tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
