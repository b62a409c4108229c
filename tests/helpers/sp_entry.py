"""torchrun entry (``-m tests.helpers.sp_entry``) for tests/distributed/test_sequence_parallel.py (2 gloo ranks): one
TTT loss and its gradients on packed multi-document rows, once whole on every rank (sp=1) and once split over the two
ranks (sp=2, Ulysses), for each drafter flavour; plus a negative control whose shards attend only to their own rows.
Rank 0 writes the largest differences as JSON to argv[1]."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fledge.data.features.batch import FeatureBatch
from fledge.distributed import World, all_reduce_sum, sequence_groups
from fledge.train.losses import SoftCrossEntropy
from fledge.train.sequence_parallel import RowShard, SequenceParallel
from tests.helpers.models import FLAGS, make_drafter

STEPS = 3


def packed_rows(T=40, H=32, n_aux=3, seed=3) -> FeatureBatch:
    """Two packed rows split at T/2 = 20: row 0's document 1 (rows 13-29) crosses the split, then a short
    document and padding; row 1's first document runs to 25, across it."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 13 + [1] * 17 + [2] * 6 + [-1] * 4, [0] * 25 + [1] * 15])
    pos = torch.zeros_like(doc)
    for b in range(2):
        for t in range(1, T):
            pos[b, t] = pos[b, t - 1] + 1 if doc[b, t] == doc[b, t - 1] else 0
    return FeatureBatch(
        input_ids=torch.randint(0, 50, (2, T), generator=g), loss_mask=torch.rand(2, T, generator=g) > 0.15,
        aux_hidden=torch.randn(2, T, n_aux * H, generator=g), target_hidden=torch.randn(2, T, H, generator=g),
        target_argmax=torch.randint(0, 44, (2, T), generator=g), position_ids=pos, document_ids=doc.int())


def loss_and_grads(drafter, loss, batch, head, shard=None):
    drafter.zero_grad(set_to_none=True)
    out = loss(drafter, batch, head, shard=shard)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    return out, grads


class _LocalOnly:
    """The negative control's group: same counts and scale, but attention stays inside the shard."""

    def __init__(self, sp):
        self.size, self.group_sum = sp.size, sp.group_sum

    @staticmethod
    def distribute(attend):
        return attend


def main() -> None:
    dist.init_process_group("gloo")
    world = World(dist.get_rank(), dist.get_world_size(), dist.get_rank(), torch.device("cpu"))
    sp = SequenceParallel(sequence_groups(world, 2), STEPS)
    loss = SoftCrossEntropy(steps=STEPS, step_weight=0.8, chunk_size=7)
    batch = packed_rows()
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    report = {}
    for name in ("eagle3", "eagle31"):
        drafter = make_drafter(seed=7, attention="sdpa", **FLAGS[name]).train()
        full, g_full = loss_and_grads(drafter, loss, batch, head)
        shard = sp.split(batch)
        part, g_part = loss_and_grads(drafter, loss, shard.batch, head, shard)
        # DeepSpeed averages over ranks: the group's mean loss and mean gradient must be the one-rank ones
        got_loss = float(all_reduce_sum(part.loss.detach()) / sp.size)
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))  # noqa: E731
        grad_rel = {n: rel(all_reduce_sum(g) / sp.size, g_full[n]) for n, g in g_part.items()}
        metric_rel = max(abs(float(all_reduce_sum(part.metrics[k][i])) - float(full.metrics[k][i]))
                         for k in full.metrics for i in (0, 1))
        local = RowShard(shard.batch, shard.batch.document_ids[:, : shard.rows], shard.rows, _LocalOnly(sp))
        ctrl, g_ctrl = loss_and_grads(drafter, loss, local.batch, head, local)
        report[name] = {
            "loss_full": float(full.loss), "loss_sp2": got_loss,
            "loss_rel": abs(got_loss - float(full.loss)) / abs(float(full.loss)),
            "grad_rel_max": max(grad_rel.values()), "grads": len(grad_rel),
            "zero_grads": [n for n, g in g_full.items() if not g.abs().sum() > 0],
            "metric_abs_max": metric_rel, "counted": float(full.metrics["loss_0"][1]),
            "control_grad_rel_max": max(rel(all_reduce_sum(g) / sp.size, g_full[n]) for n, g in g_ctrl.items()),
        }
    if world.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
