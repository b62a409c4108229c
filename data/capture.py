"""The capture stage (offline feature store) and the online feature source.

Offline: every prepared split (train, eval, eval_perturbed) is captured into ``<run>/capture/<split>/``.
Sample i goes to rank i % world. Each rank sorts its samples by length (longest first, then id) and cuts
them into target forwards of about ``capture.batch_tokens`` padded tokens: a fixed plan, so a re-run
recomputes exactly the batches an uninterrupted run computed and the store ends byte-identical.
Right padding + attention mask: causal attention never lets a real token see the pads after it.

Online (``capture.mode=online``): ``OnlineFeatureSource`` runs the target on the training rank for each
batch and yields the same FeatureBatch as the offline FeatureLoader.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from data.feature_reader import BatchIterator
from data.features import (SCHEMA_VERSION, STORE_MANIFEST, ShardWriter, bytes_per_token, encode_sample, rank_dir,
                           write_store_manifest)
from models.target import FrozenTarget

log = logging.getLogger(__name__)
SPLITS = ("train", "eval", "eval_perturbed")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja", "special_tokens_map.json")


def dataset_lengths(ds) -> list[int]:
    """Token counts of a prepared dataset's rows, from the Arrow offsets (no row is materialised)."""
    import pyarrow.compute as pc

    col = ds.data.column("input_ids")
    return pc.list_value_length(col).to_pylist()


def plan_batches(ids: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample ids into forwards with (rows x longest row) <= batch_tokens (a longer sample alone)."""
    order = sorted(ids, key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


def pad_batch(rows: list[list[int]], device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Right-pad token lists -> input_ids [B, T], attention_mask [B, T] (None when nothing is padded)."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1
    padded = any(len(r) < T for r in rows)
    return ids.to(device), (mask.to(device) if padded else None)


def capture_rows(target: FrozenTarget, rows: list[list[int]]):
    """Run the target on token lists; yield (aux [T, n*Ht], final [T, Ht], argmax [T]) per row, unpadded."""
    ids, mask = pad_batch(rows, target.device)
    aux, final, argmax = target.capture(ids, attention_mask=mask)
    for b, r in enumerate(rows):
        n = len(r)
        yield aux[b, :n], final[b, :n], argmax[b, :n]


def capture_split(target: FrozenTarget, dataset_dir: Path, store_dir: Path, cfg, world, meta: dict) -> dict:
    """Capture one prepared split into a store (this rank's part; rank 0 writes store.json at the end)."""
    from datasets import load_from_disk
    from tqdm import tqdm

    ds = load_from_disk(str(dataset_dir))
    lengths = dataset_lengths(ds)
    ids = list(range(world.rank, len(lengths), world.world_size))
    plan = plan_batches(ids, lengths, cfg.capture.batch_tokens)
    n_aux = len(meta["aux_layer_ids"])
    settings = {"world_size": world.world_size, "batch_tokens": cfg.capture.batch_tokens,
                "shard_size_mb": cfg.capture.shard_size_mb, "dtype": cfg.capture.dtype,
                "num_samples": len(lengths), "schema_version": SCHEMA_VERSION}
    writer = ShardWriter(rank_dir(store_dir, world.rank), cfg.capture.shard_size_mb * 2**20, settings)
    done_tokens = sum(lengths[i] for i in writer.done_ids)
    bar = tqdm(total=sum(lengths[i] for i in ids), initial=done_tokens, unit="tok", unit_scale=True,
               desc=f"capture {dataset_dir.name}", disable=not world.is_main, dynamic_ncols=True)
    for batch in plan:
        todo = [i for i in batch if i not in writer.done_ids]
        if not todo:
            continue
        rows = ds.select(batch)  # the whole planned batch, so the forward is the uninterrupted one
        outs = capture_rows(target, [r["input_ids"] for r in rows])
        for i, row, (aux, final, argmax) in zip(batch, rows, outs):
            if i in writer.done_ids:
                continue
            writer.add(i, encode_sample(row["input_ids"], row["loss_mask"], aux, final, argmax, n_aux,
                                        cfg.capture.dtype))
            bar.update(lengths[i])
    writer.finish()
    bar.close()
    world.barrier()
    summary = {"samples": len(lengths), "tokens": sum(lengths)}
    if world.is_main:
        m = write_store_manifest(store_dir, world.world_size, meta)
        summary.update(bytes=sum(s["bytes"] for s in m["shards"]), shards=len(m["shards"]))
    return summary


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_hash(name_or_path: str, prepare_manifest: Optional[dict]) -> Optional[str]:
    """sha256 over the target's tokenizer files (local dir), else the hash the prepare stage recorded."""
    p = Path(name_or_path)
    if p.is_dir():
        h = hashlib.sha256()
        for name in _TOKENIZER_FILES:
            if (p / name).exists():
                h.update(name.encode() + b"\0" + (p / name).read_bytes())
        return h.hexdigest()
    return ((prepare_manifest or {}).get("outputs") or {}).get("tokenizer_hash")


def store_meta(cfg, target: FrozenTarget, prepare_manifest: Optional[dict]) -> dict:
    """The store manifest's description of what was captured (everything but the shards)."""
    from train.stages import target_fingerprint

    t = cfg.target
    n_aux = len(target.aux_layer_ids)
    return {
        "target": {"name_or_path": t.name_or_path, "revision": t.revision,
                   "fingerprint": target_fingerprint(t.name_or_path), "dtype": str(target.lm_head.weight.dtype)},
        "num_hidden_layers": len(target.layers), "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "dtypes": {"aux_hidden": "float8_e4m3fn" if cfg.capture.dtype == "fp8" else "bfloat16",
                   "aux_scale": "float32" if cfg.capture.dtype == "fp8" else None,
                   "target_hidden": "bfloat16", "target_argmax": "int32", "input_ids": "int32", "loss_mask": "uint8"},
        "capture_dtype": cfg.capture.dtype,
        "bytes_per_token": bytes_per_token(n_aux, target.hidden_size, cfg.capture.dtype),
        "tokenizer_hash": tokenizer_hash(t.name_or_path, prepare_manifest),
        "prepare_manifest_hash": _hash_json(prepare_manifest) if prepare_manifest else None,
    }


def run_stage(ctx) -> dict:
    """Capture every prepared split into ``<run>/capture/<split>/`` (offline mode); a no-op online."""
    cfg = ctx.cfg
    if cfg.capture.mode == "online":
        log.warning("capture.mode=online: no feature store is written; the trainer runs the target itself")
        return {"mode": "online"}
    prep = ctx.dir_of("prepare")
    if not (prep / "train").exists():
        raise ValueError(f"{prep / 'train'} does not exist: run the prepare stage first (run.stages=[prepare,capture])")
    target = FrozenTarget.load(cfg.target, ctx.world.device, cfg.aux_layer_ids(), cfg.capture.device_map)
    meta = store_meta(cfg, target, ctx.upstream.get("prepare"))
    out: dict = {"mode": "offline", "capture_dtype": cfg.capture.dtype, "bytes_per_token": meta["bytes_per_token"]}
    t0 = time.time()
    for split in SPLITS:
        if (prep / split).exists():
            s = capture_split(target, prep / split, ctx.stage_dir / split, cfg, ctx.world, meta)
            out.update({f"{split}_{k}": v for k, v in s.items()})
    out["tokens_per_s"] = round(out.get("train_tokens", 0) / max(time.time() - t0, 1e-9), 1)
    out["store"] = {s: str(ctx.stage_dir / s / STORE_MANIFEST) for s in SPLITS if (prep / s).exists()}
    return out


class OnlineFeatureSource(BatchIterator):
    """``capture.mode=online``: the same batches as FeatureLoader, computed by the target each step.

    Samples come from the prepared split; the target runs on this rank's device, and the sample dicts
    (aux in the target's dtype, no fp8) stay on that device for collate."""

    def __init__(self, cfg, world, target: Optional[FrozenTarget] = None, split: str = "train",
                 run_dir: Optional[Path] = None, row_tokens: Optional[int] = None, rows_per_batch: Optional[int] = None):
        from datasets import load_from_disk

        run_dir = Path(run_dir) if run_dir else Path(cfg.run.output_root) / cfg.run.name
        self.ds = load_from_disk(str(run_dir / "prepare" / split))
        self.target = target or FrozenTarget.load(cfg.target, world.device, cfg.aux_layer_ids(),
                                                  cfg.capture.device_map)
        super().__init__(dataset_lengths(self.ds), world.rank, world.world_size,
                         row_tokens or cfg.train.micro_batch_tokens, rows_per_batch or cfg.train.micro_batch_size,
                         cfg.run.seed)

    def fetch(self, indices: list[int]) -> list[dict]:
        rows = self.ds.select(indices)
        out = []  # one target forward (padded) for all samples of the batch
        for row, (aux, final, argmax) in zip(rows, capture_rows(self.target, [x["input_ids"] for x in rows])):
            dev = aux.device
            out.append({"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long, device=dev),
                        "loss_mask": torch.as_tensor(row["loss_mask"], device=dev).bool(),
                        "aux_hidden": aux, "target_hidden": final, "target_argmax": argmax})
        return out
