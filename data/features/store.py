"""The feature store: what the capture stage writes and the trainer reads (data/features/reader.py).

Layout of one split's store (e.g. ``<run>/capture/train/``)::

    store.json                   manifest: target, layer ids, dtypes, hashes, the indexes, every shard's sha256
    rank00000/index.json         this rank's finished shards, each with its samples [id, offset, length]
    rank00000/shard-00000.safetensors

An array-job capture (``capture.slice_index``, data/capture/offline.py) writes ``slice00003/rank00000/...``
instead, one directory per slice since every task numbers its ranks from 0; the merge lists those
rank directories in ``store.json["indexes"]``. Sample ids are always global (prepared-row numbers),
so a reader sees one store in global sample order however it was written.

A shard concatenates several samples along dim 0 (tokens): ``input_ids`` int32 [N], ``loss_mask`` uint8
[N], ``aux_hidden`` bf16 [N, n*Ht] (or fp8-e4m3 [N, n*Ht] + ``aux_scale`` fp32 [N, n], one scale per token
per aux layer), ``target_hidden`` bf16 [N, Ht] (the final normed state), ``target_argmax`` int32 [N].

Resumability: shards are renamed into place whole, then the rank's index is rewritten (both atomic). The
samples of a rank are written in one fixed order and a shard closes as soon as it reaches its size, so
shard boundaries depend only on that order: a re-run keeps the verified shards of the index, skips their
samples and rewrites the rest byte for byte as an uninterrupted run would.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from fledge.atomic import atomic_path, read_json, sha256_file, write_json_atomic
from fledge.models.kernels.fp8 import dequantize_e4m3, quantize_e4m3

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
STORE_MANIFEST = "store.json"
INDEX = "index.json"


def rank_dir(store_dir: str | Path, rank: int) -> Path:
    return Path(store_dir) / f"rank{rank:05d}"


def slice_dir(store_dir: str | Path, index: int) -> Path:
    return Path(store_dir) / f"slice{index:05d}"


def recapture_advice(store_dir: str | Path, manifest: dict | None, shard: str | None = None,
                     stage_manifest: Path | None = None) -> str:
    """How to capture a bad store (or the slice holding ``shard``, a path relative to the store) again.
    run.force=[capture] for a plain store; an array-captured store refuses it (conf/schema.py), so there
    the slice is deleted and rerun, and merged again. ``stage_manifest``: the capture stage's manifest, which
    must go too so the stage runs again (the pipeline passes its path)."""
    n = int((manifest or {}).get("num_slices") or 1)
    if n <= 1:
        return "capture again (run.force=[capture])"
    part = Path(shard).parts[0] if shard else ""
    if part.startswith("slice") and part[5:].isdigit():
        i = int(part[5:])
        manifest_path = stage_manifest or "the capture stage's manifest"
        return (f"capture that slice again: delete {slice_dir(store_dir, i)} and {manifest_path}, run "
                f"run.stages=[capture] capture.num_slices={n} capture.slice_index={i}, then merge "
                f"(run.stages=[capture] capture.num_slices={n})")
    return (f"capture again: delete {Path(store_dir).parent}, run every slice (run.stages=[capture] "
            f"capture.num_slices={n} capture.slice_index=I), then merge (capture.num_slices={n})")


def bytes_per_token(num_aux: int, hidden_size: int, aux_dtype: str) -> int:
    """Stored bytes per token: aux (bf16, or fp8 + one fp32 scale per aux layer), final state bf16,
    argmax int32, input id int32, loss mask uint8."""
    aux = num_aux * hidden_size * 2 if aux_dtype == "bf16" else num_aux * (hidden_size + 4)
    return aux + 2 * hidden_size + 4 + 4 + 1


def encode_sample(input_ids, loss_mask, aux, final, argmax, num_aux: int, aux_dtype: str) -> dict[str, torch.Tensor]:
    """One sample's captured tensors (any device / float dtype) -> the stored CPU tensors."""
    T = aux.shape[0]
    out = {
        "input_ids": torch.as_tensor(input_ids).to("cpu", torch.int32).reshape(T),
        "loss_mask": torch.as_tensor(loss_mask).to("cpu", torch.uint8).reshape(T),
        "target_hidden": final.to("cpu", torch.bfloat16),
        "target_argmax": argmax.to("cpu", torch.int32),
    }
    if aux_dtype == "fp8":
        q, scale = quantize_e4m3(aux.reshape(T, num_aux, -1))  # per token and per aux layer
        out["aux_hidden"], out["aux_scale"] = q.reshape(T, -1).cpu(), scale.cpu()
    else:
        out["aux_hidden"] = aux.to("cpu", torch.bfloat16)
    return out


def decode_aux(aux: torch.Tensor, scale: torch.Tensor | None, num_aux: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Stored aux [T, n*Ht] (bf16, or fp8 with scale [T, n]) -> float [T, n*Ht] of ``dtype``."""
    if scale is None:
        return aux.to(dtype)
    T = aux.shape[0]
    return dequantize_e4m3(aux.reshape(T, num_aux, -1), scale, dtype).reshape(T, -1)


class ShardWriter:
    """Writes one rank's samples into size-bounded shards; resumes from the rank's index."""

    def __init__(self, directory: str | Path, shard_bytes: int, settings: dict):
        self.dir = Path(directory)
        self.shard_bytes = max(1, int(shard_bytes))
        self.settings = settings  # anything the shard bytes depend on; a mismatch starts the rank over
        self.shards: list[dict] = self._resume()
        self.done_ids = {s[0] for sh in self.shards for s in sh["samples"]}
        self._buf: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._buf_bytes = 0

    def _resume(self) -> list[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        index = read_json(self.dir / INDEX) or {"shards": []}
        if index.get("settings", self.settings) != self.settings:
            log.warning("%s: written with other settings (%s); capturing this rank again", self.dir, index["settings"])
            index["shards"] = []
        kept = []
        for sh in index["shards"]:
            path = self.dir / sh["name"]
            if not path.exists() or path.stat().st_size != sh["bytes"] or sha256_file(path) != sh["sha256"]:
                log.warning("%s: missing or corrupt; it and the shards after it are captured again", path)
                break
            kept.append(sh)
        if kept:
            log.info("%s: resuming after %d verified shards", self.dir, len(kept))
        # A kill can leave temporaries and shards renamed into place but not yet indexed: drop them.
        names = {sh["name"] for sh in kept} | {INDEX}
        for p in self.dir.iterdir():
            if p.name not in names:
                _remove_path(p)
        return kept

    def add(self, sample_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Append one encoded sample (see encode_sample); a shard is written once it reaches its size."""
        assert sample_id not in self.done_ids, sample_id
        self._buf.append((sample_id, tensors))
        self._buf_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if self._buf_bytes >= self.shard_bytes:
            self._flush()

    def finish(self) -> list[dict]:
        """Write the last (partial-size) shard and mark the rank's index complete."""
        if self._buf:
            self._flush()
        self._write_index(complete=True)
        return self.shards

    def _flush(self) -> None:
        from safetensors.torch import save_file

        samples, offset = [], 0
        for sid, t in self._buf:
            n = t["input_ids"].shape[0]
            samples.append([sid, offset, n])
            offset += n
        tensors = {k: torch.cat([t[k] for _, t in self._buf]) for k in self._buf[0][1]}
        name = f"shard-{len(self.shards):05d}.safetensors"
        path = self.dir / name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
            digest = sha256_file(tmp)
            size = os.path.getsize(tmp)
        self.shards.append({"name": name, "sha256": digest, "bytes": size, "tokens": offset, "samples": samples})
        self.done_ids.update(s[0] for s in samples)
        self._buf, self._buf_bytes = [], 0
        self._write_index(complete=False)

    def _write_index(self, complete: bool) -> None:
        write_json_atomic(self.dir / INDEX, {"settings": self.settings, "complete": complete, "shards": self.shards})


def _remove_path(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def index_problem(store_dir: str | Path, parts: list[str], ids: range) -> str | None:
    """What keeps the rank indexes ``parts`` of a store from holding each sample id of ``ids`` exactly
    once (an unfinished rank, duplicated or missing samples), or None when they do. Reads only the
    small index files."""
    store_dir = Path(store_dir)
    seen = []
    for part in parts:
        index = read_json(store_dir / part / INDEX)
        if not index or not index.get("complete"):
            return f"{store_dir / part}: capture of this rank is not complete"
        seen += [s[0] for sh in index["shards"] for s in sh["samples"]]
    if sorted(seen) != list(ids):
        dup, missing = len(seen) - len(set(seen)), len(set(ids) - set(seen))
        return f"the indexes of {parts} hold {dup} duplicate and miss {missing} of their {len(ids)} samples"
    return None


def store_manifest(store_dir: str | Path, parts: list[str], meta: dict, num_samples: int, **fields) -> dict:
    """The ``store.json`` content over the finished indexes in ``parts`` (rank dirs relative to the store,
    e.g. ``rank00000`` or ``slice00003/rank00001``). Checks that every index is complete and that the
    parts hold each sample id in [0, num_samples) exactly once (ValueError naming the fix); reads only
    the small index files. An array capture checks each slice first (data/capture/offline.py merge_slices), so
    this advice is the plain store's."""
    store_dir = Path(store_dir)
    problem = index_problem(store_dir, parts, range(num_samples))
    if problem:
        raise ValueError(f"{store_dir}: {problem}; capture again (run.force=[capture])")
    shards, num_tokens = [], 0
    for part in parts:
        for sh in read_json(store_dir / part / INDEX)["shards"]:
            shards.append({"path": f"{part}/{sh['name']}", "sha256": sh["sha256"], "bytes": sh["bytes"],
                           "tokens": sh["tokens"], "num_samples": len(sh["samples"])})
            num_tokens += sh["tokens"]
    return dict(meta, schema_version=SCHEMA_VERSION, **fields, indexes=list(parts), num_samples=num_samples,
                num_tokens=num_tokens, shards=shards, complete=True)


def write_store_manifest(store_dir: str | Path, parts: list[str], meta: dict, num_samples: int, **fields) -> dict:
    """Write ``store.json`` (see store_manifest) once every part has finished (one process, at the end)."""
    store_dir = Path(store_dir)
    for p in store_dir.glob(f".{STORE_MANIFEST}*"):  # temporaries of a killed earlier write
        _remove_path(p)
    manifest = store_manifest(store_dir, parts, meta, num_samples, **fields)
    write_json_atomic(store_dir / STORE_MANIFEST, manifest)
    return manifest
