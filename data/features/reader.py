"""Reading the feature store for training: memory-mapped, rank-sharded, shuffled, exactly resumable.

``FeatureStore`` is a read-only view of one split's store (data/features/store.py): the manifest, the sample
table from the ranks' indexes, and shards opened on demand with safetensors' mmap (a sample read touches
only its own byte ranges). A shard's sha256 is checked the first time it is opened. Every path the
manifest and the indexes name is relative to the store and must stay inside it (no ``..``, not absolute):
a copied or hand-edited store must not make training read files it was never pointed at.
``FeatureLoader`` turns the store into FeatureBatch objects with data.packing.plan_rows/collate; the online
sources (data/capture/online.py, stream.py) share its batching through ``BatchIterator``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from fledge.atomic import read_json, sha256_file
from fledge.conf.schema import TargetConfig
from fledge.data.features.batch import FeatureBatch
from fledge.data.features.packing import collate, plan_rows
from fledge.data.features.source import FeatureSource
from fledge.data.features.store import INDEX, SCHEMA_VERSION, STORE_MANIFEST, decode_aux, rank_dir, recapture_advice
from fledge.models.weights import is_contained


class FeatureStore:
    """A finished store: ``len(store)`` samples, sorted by prepared-sample id; ``store[i]`` is a dict."""

    def __init__(self, store_dir: str | Path, max_open_shards: int = 16, dtype: torch.dtype = torch.bfloat16,
                 stage_manifest: Path | None = None):
        """``stage_manifest``: the manifest of the stage that wrote the store, named in the advice on capturing
        a slice again (the pipeline's, fledge/run_layout.py)."""
        self.dir = Path(store_dir)
        self.stage_manifest = stage_manifest
        m = read_json(self.dir / STORE_MANIFEST)
        if not m or not m.get("complete"):
            raise ValueError(f"{self.dir}: no complete {STORE_MANIFEST}; run the capture stage "
                             f"(run.stages=[capture]) to finish the store")
        if m.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{self.dir / STORE_MANIFEST}: schema_version={m.get('schema_version')}, this code "
                             f"reads {SCHEMA_VERSION}; {recapture_advice(self.dir, m, stage_manifest=stage_manifest)}")
        self.manifest = m
        self.dtype = dtype
        self.num_aux = len(m["aux_layer_ids"])
        manifest = self.dir / STORE_MANIFEST
        for sh in m["shards"]:
            _check_contained(manifest, "shards[].path", sh["path"])
        self._sha = {sh["path"]: sh["sha256"] for sh in m["shards"]}
        rows = []  # (sample_id, shard path, offset, length)
        # Older manifests have no "indexes": one rank directory per rank of the capture.
        parts = m.get("indexes") or [rank_dir("", r).name for r in range(m["world_size"])]
        for part in parts:
            _check_contained(manifest, "indexes", part)
            index = self.dir / part / INDEX
            for sh in read_json(index)["shards"]:
                _check_contained(index, "shards[].name", sh["name"])
                rows += [(sid, f"{part}/{sh['name']}", off, n) for sid, off, n in sh["samples"]]
        rows.sort()  # global sample order, whatever ranks or slices wrote the samples
        self.sample_ids = [r[0] for r in rows]
        self._loc = [r[1:] for r in rows]
        self.lengths = [r[3] for r in rows]
        self._open: OrderedDict[str, object] = OrderedDict()
        self._verified: set[str] = set()
        self.max_open = max_open_shards

    def __len__(self) -> int:
        return len(self._loc)

    def check_compatible(self, target: TargetConfig, aux_layer_ids: Sequence[int]) -> None:
        """Refuse (ValueError) a store captured from another target / layer ids / sizes than the
        ``target`` config and ``aux_layer_ids`` a run trains with."""
        m, t = self.manifest, target
        want = {"target.name_or_path": t.name_or_path, "target.revision": t.revision,
                "target.num_hidden_layers": t.num_hidden_layers, "target.hidden_size": t.hidden_size,
                "target.vocab_size": t.vocab_size, "drafter.aux_layer_ids": list(aux_layer_ids)}
        have = {"target.name_or_path": m["target"]["name_or_path"], "target.revision": m["target"]["revision"],
                "target.num_hidden_layers": m["num_hidden_layers"], "target.hidden_size": m["hidden_size"],
                "target.vocab_size": m["vocab_size"], "drafter.aux_layer_ids": m["aux_layer_ids"]}
        for key, v in want.items():
            if key in ("target.num_hidden_layers", "target.hidden_size", "target.vocab_size") and not v:
                continue  # not written in the recipe: nothing to compare
            if have[key] != v:
                raise ValueError(f"feature store {self.dir} was captured with {key}={have[key]!r} but the "
                                 f"config has {key}={v!r}; "
                                 f"{recapture_advice(self.dir, m, stage_manifest=self.stage_manifest)} or fix {key}")

    def _shard(self, path: str):
        from safetensors import safe_open

        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        full = self.dir / path
        if path not in self._verified:
            if path not in self._sha:
                raise ValueError(f"feature shard {full} is in an index but not in {self.dir / STORE_MANIFEST}; "
                                 f"{recapture_advice(self.dir, self.manifest, path, self.stage_manifest)}")
            if not full.exists():
                advice = recapture_advice(self.dir, self.manifest, path, self.stage_manifest)
                raise ValueError(f"feature shard {full} is missing; {advice}")
            if sha256_file(full) != self._sha[path]:
                raise ValueError(f"feature shard {full} fails its sha256 checksum (corrupt or modified); "
                                 f"{recapture_advice(self.dir, self.manifest, path, self.stage_manifest)}")
            self._verified.add(path)
        handle = safe_open(str(full), framework="pt")  # mmap: slices read only their byte ranges
        self._open[path] = handle
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return handle

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        path, off, n = self._loc[i]
        f = self._shard(path)
        get = lambda k: f.get_slice(k)[off:off + n]  # noqa: E731
        scale = get("aux_scale") if "aux_scale" in f.keys() else None
        return {
            "input_ids": get("input_ids").long(),
            "loss_mask": get("loss_mask").bool(),
            "aux_hidden": decode_aux(get("aux_hidden"), scale, self.num_aux, self.dtype),
            "target_hidden": get("target_hidden").to(self.dtype),
            "target_argmax": get("target_argmax").long(),
        }


def _check_contained(listing: Path, key: str, entry: object) -> None:
    if not is_contained(entry):
        raise ValueError(f"{listing}: {key} entry {entry!r} points outside {listing.parent}; a feature store "
                         "names only files inside its own directories (capture again with run.force=[capture], "
                         "or fix that entry)")


class BatchIterator(FeatureSource):
    """A global batch plan that does not depend on the world size, and an exactly resumable position.

    Epoch e packs all samples into rows (data.packing.plan_rows, seed + e), groups rows
    ``rows_per_batch`` at a time and shuffles the batches (seed + e). The global sequence is epoch 0's
    batches, then epoch 1's, ... with nothing dropped: packing depends only on the lengths, so every epoch
    has the same ``global_batches_per_epoch``, and global batch g is batch g % N of epoch g // N whatever
    the world size. Ranks take it in rounds: round i gives rank r global batch i * world + r (a round may
    straddle two epochs), so every rank runs the same number of steps and collectives. The position is
    the number of global batches consumed by all ranks together, so 2 ranks x 1 batch and 1 rank x 2
    batches (gradient accumulation) see the same sequence in every epoch, and a resume on another world
    size continues where the run stopped. Subclasses implement ``fetch``; a source that waits for its batches
    overrides the ``FeatureSource`` methods (data/features/source.py)."""

    def __init__(self, lengths: list[int], rank: int, world: int, row_tokens: int, rows_per_batch: int, seed: int):
        self.lengths, self.rank, self.world = list(lengths), rank, world
        self.row_tokens, self.rows_per_batch, self.seed = row_tokens, rows_per_batch, seed
        self.position = 0
        self.end: int | None = None  # the global batch the run stops before, once the trainer says (seek)
        self._plan_cache: tuple[int, list] | None = None
        if not self.lengths:
            raise ValueError("no samples to train on; check the prepare stage's counts (kept/dropped)")

    def fetch(self, indices: list[int]) -> list[dict]:
        raise NotImplementedError

    def global_plan(self, epoch: int) -> list[list[list[int]]]:
        """All batches of ``epoch``: a list of batches, each a list of rows of sample indices."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:

            rows = plan_rows(self.lengths, self.row_tokens, self.seed + epoch)
            batches = [rows[i:i + self.rows_per_batch] for i in range(0, len(rows), self.rows_per_batch)]
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            order = torch.randperm(len(batches), generator=g).tolist()
            self._plan_cache = (epoch, [batches[i] for i in order])
        return self._plan_cache[1]

    @property
    def global_batches_per_epoch(self) -> int:
        """Batches in every epoch's plan (the same for any world size and any epoch)."""
        return len(self.global_plan(0))

    @property
    def rounds_per_epoch(self) -> int:
        """Whole rounds of ``world`` batches in one epoch: this rank's batches per epoch (``len``)."""
        n = self.global_batches_per_epoch // self.world
        if n == 0:
            raise ValueError(f"{self.global_batches_per_epoch} batches per epoch cannot feed {self.world} ranks; "
                             "lower train.micro_batch_tokens / micro_batch_size or add data")
        return n

    def __len__(self) -> int:
        """This rank's batches per epoch."""
        return self.rounds_per_epoch

    def batch_at(self, g: int) -> FeatureBatch:
        """Global batch ``g`` (counted across epochs)."""

        epoch, i = divmod(g, self.global_batches_per_epoch)
        rows = self.global_plan(epoch)[i]
        flat = iter(self.fetch([j for row in rows for j in row]))
        return collate([[next(flat) for _ in row] for row in rows], self.row_tokens)

    def next_batch(self) -> tuple[int, FeatureBatch]:
        """This rank's next batch and its global index; the position advances by one round."""
        g = self.position + self.rank
        self.position += self.world
        return g, self.batch_at(g)

    def seek(self, position: int, end: int | None = None) -> None:
        """Continue at global batch ``position``; ``end``: the global batch the run stops before (a source that
        makes its batches ahead of the trainer, the online stream, makes none from there on)."""
        self.position = int(position)
        if end is not None:
            self.end = int(end)

    def __iter__(self) -> Iterator[FeatureBatch]:
        """This rank's next ``len(self)`` batches: one epoch's worth of rounds from the current position."""
        for _ in range(len(self)):
            yield self.next_batch()[1]

    def eval_batches(self, n: int) -> Iterator[tuple[FeatureBatch, bool]]:
        """This rank's share of the held-out set, as (batch, counts): global batches 0..n-1 of epoch 0 (at
        most the whole epoch), rank r taking r, r + W, ...: the same set at every eval and on every world
        size. Every rank yields the same number of batches, since each forward may be a collective (ZeRO-3
        gathers the weights): a rank whose share is one short gets global batch 0 again, not to be counted."""
        n = min(n, self.global_batches_per_epoch)
        for g in range(self.rank, -(-n // self.world) * self.world, self.world):
            yield (self.batch_at(g), True) if g < n else (self.batch_at(0), False)


class FeatureLoader(BatchIterator):
    """FeatureBatch iterator over an offline store (see BatchIterator for order and resumption); check the
    store against the run with ``loader.store.check_compatible`` first."""

    def __init__(self, store_dir: str | Path, rank: int, world: int, row_tokens: int, rows_per_batch: int,
                 seed: int, dtype: torch.dtype = torch.bfloat16, stage_manifest: Path | None = None):
        self.store = FeatureStore(store_dir, dtype=dtype, stage_manifest=stage_manifest)
        super().__init__(self.store.lengths, rank, world, row_tokens, rows_per_batch, seed)

    def fetch(self, indices: list[int]) -> list[dict]:
        return [self.store[i] for i in indices]

