"""The capture stage: the offline feature store.

Offline: every prepared split (train, eval, eval_perturbed) is captured into ``<run>/capture/<split>/``.
Sample i goes to rank i % world. Each rank sorts its samples by length (longest first, then id) and cuts
them into target forwards of about ``capture.batch_tokens`` padded tokens: a fixed plan, so a re-run
recomputes exactly the batches an uninterrupted run computed and the store ends byte-identical.
Right padding + attention mask: causal attention never lets a real token see the pads after it.

Array capture (``capture.slice_index=i`` of ``capture.num_slices=N``, one Slurm array task each): slice
i is samples [i*n/N, (i+1)*n/N) of every split, cut between the task's ranks the same way, written to
``<split>/sliceNNNNN/`` and recorded in ``capture/slices/``; the stage stays incomplete. A later run with
``num_slices=N`` and no slice index merges: it writes each split's store.json over all slices (or names
the slices to rerun), and the stage is complete. The merged store reads like a plain one (same samples,
same ids), so training does not depend on how it was captured.

Through vLLM (``capture.engine=vllm``) the same plan and writer are fed by the engine (data/capture/engine.py,
which sets the engine up for this and for the online stream alike). What the trainer reads, this store or the
target online, is chosen in data/capture/sources.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from fledge.atomic import read_json, write_json_atomic
from fledge.conf.schema import CaptureConfig, TargetConfig
from fledge.data.capture.engine import capture_with_engine, engine_setup
from fledge.data.features.store import (
    SCHEMA_VERSION,
    STORE_MANIFEST,
    ShardWriter,
    bytes_per_token,
    encode_sample,
    index_problem,
    rank_dir,
    slice_dir,
    store_manifest,
    write_store_manifest,
)
from fledge.distributed import World, broadcast_object
from fledge.models.target import FrozenTarget, target_fingerprint
from fledge.progress import progress
from fledge.run_layout import CaptureDir, PrepareDir

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


def pad_batch(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad token lists -> input_ids [B, T], attention_mask [B, T] (None when nothing is padded)."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1
    padded = any(len(r) < T for r in rows)
    return ids.to(device), (mask.to(device) if padded else None)


def capture_rows(target: FrozenTarget, rows: list[list[int]], chunk_tokens: int = 0):
    """Run the target on token lists; yield (aux [T, n*Ht], final [T, Ht], argmax [T]) per row, unpadded.
    Rows longer than ``chunk_tokens`` (> 0) are read in pieces through the target's KV cache."""
    ids, mask = pad_batch(rows, target.device)
    aux, final, argmax = target.capture(ids, attention_mask=mask, chunk_tokens=chunk_tokens)
    for b, r in enumerate(rows):
        n = len(r)
        yield aux[b, :n], final[b, :n], argmax[b, :n]


def slice_bounds(num_samples: int, index: int | None, num_slices: int) -> tuple[int, int]:
    """Sample ids [lo, hi) of slice ``index`` of ``num_slices`` (all samples when index is None)."""
    if index is None:
        return 0, num_samples
    return index * num_samples // num_slices, (index + 1) * num_samples // num_slices


class SplitCapture:
    """One split's capture on this rank: the fixed batch plan, the resumable shard writer, progress.

    ``todo()`` lists the planned batches that still hold unwritten samples (each whole, so a resumed run
    computes the very forwards of an uninterrupted one); ``add`` stores one sample's states; ``finish``
    closes the rank and (rank 0, no slice) writes store.json. Both engines drive it the same way."""

    def __init__(self, dataset_dir: Path, store_dir: Path, cap: CaptureConfig, world, meta: dict):
        from datasets import load_from_disk

        self.ds = load_from_disk(str(dataset_dir))
        self.lengths = dataset_lengths(self.ds)
        self.store_dir, self.cap, self.world, self.meta = store_dir, cap, world, meta
        self.part = cap.slice_index
        self.lo, self.hi = slice_bounds(len(self.lengths), self.part, cap.num_slices)
        self.out_dir = store_dir if self.part is None else slice_dir(store_dir, self.part)
        ids = list(range(self.lo + world.rank, self.hi, world.world_size))
        self.plan = plan_batches(ids, self.lengths, cap.batch_tokens)
        self.n_aux = len(meta["aux_layer_ids"])
        settings = {"world_size": world.world_size, "batch_tokens": cap.batch_tokens,
                    "shard_size_mb": cap.shard_size_mb, "dtype": cap.dtype,
                    "num_samples": len(self.lengths), "schema_version": SCHEMA_VERSION}
        if self.part is not None:
            settings["slice"] = [self.part, cap.num_slices]
        if cap.engine != "hf":  # an HF-captured rank is not resumed by another engine (nor the reverse)
            settings["engine"] = cap.engine
        self.writer = ShardWriter(rank_dir(self.out_dir, world.rank), cap.shard_size_mb * 2**20, settings)
        done_tokens = sum(self.lengths[i] for i in self.writer.done_ids)
        self.bar = progress(total=sum(self.lengths[i] for i in ids), initial=done_tokens, unit="tok", unit_scale=True,
                            desc=f"capture {dataset_dir.name}", disable=not world.is_main)

    def todo(self) -> list[list[int]]:
        return [b for b in self.plan if any(i not in self.writer.done_ids for i in b)]

    def add(self, i: int, row: dict, aux, final, argmax) -> None:
        if i in self.writer.done_ids:
            return
        self.writer.add(i, encode_sample(row["input_ids"], row["loss_mask"], aux, final, argmax, self.n_aux,
                                         self.cap.dtype))
        self.bar.update(self.lengths[i])

    def finish(self) -> dict:
        self.writer.finish()
        self.bar.close()
        self.world.barrier()
        world, lo, hi = self.world, self.lo, self.hi
        summary = {"samples": hi - lo, "tokens": sum(self.lengths[lo:hi])}
        if world.is_main and self.part is None:
            m = write_store_manifest(self.store_dir, [rank_dir("", r).name for r in range(world.world_size)],
                                     self.meta, len(self.lengths), world_size=world.world_size)
            summary.update(bytes=sum(s["bytes"] for s in m["shards"]), shards=len(m["shards"]))
        elif world.is_main:
            for stale in self.out_dir.glob("rank*"):  # an earlier attempt of this slice on more ranks
                if int(stale.name[4:]) >= world.world_size:
                    shutil.rmtree(stale, ignore_errors=True)
            summary.update(range=[lo, hi], of=len(self.lengths))
        return summary


def capture_split(target: FrozenTarget, dataset_dir: Path, store_dir: Path, cap: CaptureConfig, world,
                  meta: dict) -> dict:
    """Capture one prepared split into a store with the in-process target (this rank's part; rank 0
    writes store.json at the end).

    With ``cap.slice_index`` set only that slice's samples are captured, into ``store_dir/sliceNNNNN``,
    and no store.json is written (merge_slices does it once every slice has finished)."""
    sc = SplitCapture(dataset_dir, store_dir, cap, world, meta)
    for batch in sc.todo():
        rows = sc.ds.select(batch)  # the whole planned batch, so the forward is the uninterrupted one
        outs = capture_rows(target, [r["input_ids"] for r in rows], cap.chunk_tokens)
        for i, row, (aux, final, argmax) in zip(batch, rows, outs):
            sc.add(i, row, aux, final, argmax)
    return sc.finish()


def _array_spec(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (sbatch --array syntax)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def merge_slices(n: int, world: World, stores: CaptureDir, splits: list[str], array_script: Path) -> dict:
    """Make the finished slices of an array capture one store per split (``store.json`` over every
    slice's rank indexes); raises ValueError naming the slices still missing and how to rerun them."""
    records = [read_json(stores.slice_record(i)) for i in range(n)]
    missing = [i for i, r in enumerate(records) if not r or r.get("num_slices") != n]
    if missing:
        spec = _array_spec(missing)
        raise ValueError(
            f"capture.num_slices={n}: slices {spec} have not finished (no {stores.slice_record(missing[0])} "
            f"and the like); rerun them with `sbatch --array={spec} {array_script}` "
            f"(or run.stages=[capture] capture.slice_index=I for each), then run this again")
    meta = records[0]["meta"]
    odd = [i for i, r in enumerate(records) if r["meta"] != meta or sorted(r["splits"]) != sorted(splits)]
    if odd:
        raise ValueError(f"capture slices {_array_spec(odd)} were captured from another target or prepared data "
                         f"than slice 0 ({stores.slice_record(odd[0])}); delete those records and rerun "
                         f"them: sbatch --array={_array_spec(odd)} {array_script}")
    out: dict = {"mode": "offline", "capture_dtype": meta["capture_dtype"], "bytes_per_token": meta["bytes_per_token"],
                 "slices": n}
    slice_parts = [[f"{slice_dir('', i).name}/{rank_dir('', r).name}" for r in range(rec["world_size"])]
                   for i, rec in enumerate(records)]
    for split in splits:  # each slice whole first, so the message names the slices to redo
        problems = [index_problem(stores.store(split), ps, range(*rec["splits"][split]["range"]))
                    for ps, rec in zip(slice_parts, records)]
        bad = [i for i, p in enumerate(problems) if p]
        if bad:
            spec = _array_spec(bad)
            raise ValueError(
                f"capture.num_slices={n}: the {split} store's slices {spec} do not hold their samples exactly once "
                f"({problems[bad[0]]}); delete {' and '.join(str(slice_dir(stores.store(split), i)) for i in bad)}, "
                f"rerun them with `sbatch --array={spec} {array_script}` (or run.stages=[capture] "
                f"capture.slice_index=I for each: {', '.join(f'capture.slice_index={i}' for i in bad)}), then run "
                "this again")
        parts = [p for ps in slice_parts for p in ps]
        total = records[0]["splits"][split]["of"]
        fields = dict(num_slices=n, slice_world_sizes=[r["world_size"] for r in records])
        # Every rank checks the indexes (so all raise together); rank 0 writes.
        m = store_manifest(stores.store(split), parts, meta, total, **fields)
        if world.is_main:
            write_store_manifest(stores.store(split), parts, meta, total, **fields)
        out.update({f"{split}_samples": m["num_samples"], f"{split}_tokens": m["num_tokens"],
                    f"{split}_bytes": sum(s["bytes"] for s in m["shards"]), f"{split}_shards": len(m["shards"])})
    world.barrier()
    return out


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _prepare_hash(manifest: dict) -> str:
    """What the prepared data is: the prepare stage's inputs hash and counts. Not its wall-clock time,
    pid or paths, so the same capture in another run directory or world layout writes the same store.json."""
    outputs = {k: v for k, v in (manifest.get("outputs") or {}).items() if k != "paths"}
    return _hash_json({"inputs_hash": manifest.get("inputs_hash"), "outputs": outputs})


def tokenizer_hash(name_or_path: str, prepare_manifest: dict | None) -> str | None:
    """sha256 over the target's tokenizer files (local dir), else the hash the prepare stage recorded."""
    p = Path(name_or_path)
    if p.is_dir():
        h = hashlib.sha256()
        for name in _TOKENIZER_FILES:
            if (p / name).exists():
                h.update(name.encode() + b"\0" + (p / name).read_bytes())
        return h.hexdigest()
    return ((prepare_manifest or {}).get("outputs") or {}).get("tokenizer_hash")


def store_meta(t: TargetConfig, aux_dtype: str, target: FrozenTarget, prepare_manifest: dict | None) -> dict:
    """The store manifest's description of what was captured (everything but the shards): ``target``
    loaded from the config ``t``, aux states stored as ``aux_dtype`` (capture.dtype: bf16 | fp8)."""
    return describe_store(t, aux_dtype, list(target.aux_layer_ids), len(target.layers), target.hidden_size,
                          target.vocab_size, str(target.lm_head.weight.dtype), prepare_manifest)


def describe_store(t: TargetConfig, aux_dtype: str, aux_layer_ids: Sequence[int], num_layers: int, hidden_size: int,
                   vocab_size: int, compute_dtype: str, prepare_manifest: dict | None) -> dict:
    """store_meta from the target's numbers (the vLLM path has no in-process model to read them from)."""
    n_aux = len(aux_layer_ids)
    return {
        "target": {"name_or_path": t.name_or_path, "revision": t.revision,
                   "fingerprint": target_fingerprint(t.name_or_path), "dtype": compute_dtype},
        "num_hidden_layers": num_layers, "hidden_size": hidden_size, "vocab_size": vocab_size,
        "aux_layer_ids": list(aux_layer_ids),
        "dtypes": {"aux_hidden": "float8_e4m3fn" if aux_dtype == "fp8" else "bfloat16",
                   "aux_scale": "float32" if aux_dtype == "fp8" else None,
                   "target_hidden": "bfloat16", "target_argmax": "int32", "input_ids": "int32", "loss_mask": "uint8"},
        "capture_dtype": aux_dtype,
        "bytes_per_token": bytes_per_token(n_aux, hidden_size, aux_dtype),
        "tokenizer_hash": tokenizer_hash(t.name_or_path, prepare_manifest),
        "prepare_manifest_hash": _prepare_hash(prepare_manifest) if prepare_manifest else None,
    }


def engine_workdir(out: CaptureDir, slice_index: int | None) -> Path:
    """Where ``capture.engine=vllm`` keeps its engines' files (request, token files, spool, connector,
    log; one ``rankNNNNN`` directory per rank): the stage's engine directory, or its ``sliceNNNNN/`` for an
    array task, since the tasks of one capture run at the same time and each numbers its ranks from 0."""
    return out.engine_work if slice_index is None else slice_dir(out.engine_work, slice_index)


def _fresh_done_dir(work: Path, world: World) -> Path:
    """The directory where this capture's vLLM data-parallel ranks say their engine is done. Rank 0
    removes those of earlier attempts and names a new one for all ranks, so a killed run's markers
    never count."""
    name = None
    if world.is_main:
        for old in work.glob("dp-*"):
            shutil.rmtree(old, ignore_errors=True)
        name = f"dp-{uuid.uuid4().hex[:12]}"
    return work / broadcast_object(name)


def capture_engine(target_cfg: TargetConfig, cap: CaptureConfig, aux_layer_ids: Sequence[int], world: World,
                   prep: PrepareDir, out: CaptureDir, splits: list[str],
                   prepare_manifest: dict | None) -> tuple[dict, dict]:
    """``capture.engine=vllm``: every split through one vLLM run on this rank (data/capture/engine.py).
    Returns (store meta, {split: summary})."""
    eng = engine_setup(target_cfg, cap, aux_layer_ids, world, cap.data_parallel_size)
    shape = eng.shape
    meta = describe_store(target_cfg, cap.dtype, aux_layer_ids, shape.num_hidden_layers, shape.hidden_size,
                          shape.vocab_size, str(eng.dtype), prepare_manifest)
    meta["engine"] = "vllm"
    states = {split: SplitCapture(prep.split(split), out.store(split), cap, world, meta) for split in splits}
    parallel = {"tensor_parallel_size": cap.tensor_parallel_size, "expert_parallel": cap.expert_parallel,
                "data_parallel_size": cap.data_parallel_size}
    work = engine_workdir(out, cap.slice_index)
    if cap.data_parallel_size > 1:
        parallel.update(data_parallel_rank=world.rank, data_parallel_done=str(_fresh_done_dir(work, world)))
    result = capture_with_engine(states, eng.python, target_cfg.name_or_path, target_cfg.revision,
                                 target_cfg.trust_remote_code, eng.dtype, aux_layer_ids, shape.num_hidden_layers,
                                 shape.rms_norm_eps, parallel, eng.env, rank_dir(work, world.rank),
                                 cap.engine_timeout_s, world.device)
    per_split = {split: sc.finish() for split, sc in states.items()}
    for split, r in (result.get("jobs") or {}).items():
        per_split[split]["engine_tokens_per_s"] = round(r["tokens"] / max(r["wall_s"], 1e-9), 1)
    return meta, per_split


def capture(target_cfg: TargetConfig, cap: CaptureConfig, aux_layer_ids: Sequence[int], world: World, prep: PrepareDir,
            out_dir: CaptureDir, prepare_manifest: dict | None, array_script: Path) -> dict:
    """Capture the states at ``aux_layer_ids`` of the target ``target_cfg`` names for every prepared split
    of ``prep`` into the feature stores of ``out_dir`` (``cap.mode=offline``); a no-op online.

    Array capture: with ``cap.slice_index`` set, capture that slice only, record it in
    ``capture/slices/`` and return a partial summary (the stage stays incomplete); with
    ``cap.num_slices > 1`` and no slice index, merge the finished slices instead of capturing."""
    if cap.mode == "online":
        log.warning("capture.mode=online: no feature store is written; the trainer runs the target itself "
                    "(capture.engine=hf) or streams it from a vLLM engine (capture.engine=vllm)")
        return {"mode": "online"}
    if not prep.split("train").exists():
        raise ValueError(f"{prep.split('train')} does not exist: run the prepare stage first "
                         "(run.stages=[prepare,capture])")
    splits = [s for s in SPLITS if prep.split(s).exists()]
    part = cap.slice_index
    if part is None and cap.num_slices > 1:
        out = merge_slices(cap.num_slices, world, out_dir, splits, array_script)
    else:
        if part is not None and world.is_main:
            out_dir.slice_record(part).unlink(missing_ok=True)  # this slice is being (re)written
        t0 = time.time()
        if cap.engine == "vllm":
            meta, per_split = capture_engine(target_cfg, cap, aux_layer_ids, world, prep, out_dir, splits,
                                             prepare_manifest)
        else:
            target = FrozenTarget.load(target_cfg, world.device, aux_layer_ids, cap.device_map)
            meta = store_meta(target_cfg, cap.dtype, target, prepare_manifest)
            t0 = time.time()  # the forward's speed, not the load's
            per_split = {split: capture_split(target, prep.split(split), out_dir.store(split), cap, world, meta)
                         for split in splits}
        out = {"mode": "offline", "capture_dtype": cap.dtype, "bytes_per_token": meta["bytes_per_token"],
               **({"engine": cap.engine} if cap.engine != "hf" else {})}
        for split, s in per_split.items():
            out.update({f"{split}_{k}": v for k, v in s.items() if k not in ("range", "of")})
        out["tokens_per_s"] = round(out.get("train_tokens", 0) / max(time.time() - t0, 1e-9), 1)
        if part is not None:
            if world.is_main:
                write_json_atomic(out_dir.slice_record(part), {
                    "slice_index": part, "num_slices": cap.num_slices, "world_size": world.world_size,
                    "meta": meta, "splits": per_split})
            log.info("capture slice %d of %d done; merge with capture.num_slices=%d (no slice_index) when all are",
                     part, cap.num_slices, cap.num_slices)
            return dict(out, complete=False, slice_index=part, num_slices=cap.num_slices)
    out["store"] = {s: str(out_dir.store(s) / STORE_MANIFEST) for s in splits}
    return out
