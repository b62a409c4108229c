"""Reading the feature store for training: memory-mapped, rank-sharded, shuffled, exactly resumable.

``FeatureStore`` is a read-only view of one split's store (data/features.py): the manifest, the sample
table from the ranks' indexes, and shards opened on demand with safetensors' mmap (a sample read touches
only its own byte ranges). A shard's sha256 is checked the first time it is opened.
``FeatureLoader`` turns the store into FeatureBatch objects with data.packing.plan_rows/collate; the online
source (data/capture.py) shares its batching through ``BatchIterator``.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Optional

import torch

from data.atomic import read_json, sha256_file
from data.batch import FeatureBatch
from data.features import INDEX, SCHEMA_VERSION, STORE_MANIFEST, decode_aux, rank_dir


class FeatureStore:
    """A finished store: ``len(store)`` samples, sorted by prepared-sample id; ``store[i]`` is a dict."""

    def __init__(self, store_dir: str | Path, max_open_shards: int = 16, dtype: torch.dtype = torch.bfloat16):
        self.dir = Path(store_dir)
        m = read_json(self.dir / STORE_MANIFEST)
        if not m or not m.get("complete"):
            raise ValueError(f"{self.dir}: no complete {STORE_MANIFEST}; run the capture stage "
                             f"(run.stages=[capture]) to finish the store")
        if m.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{self.dir / STORE_MANIFEST}: schema_version={m.get('schema_version')}, this code "
                             f"reads {SCHEMA_VERSION}; capture again (run.force=[capture])")
        self.manifest = m
        self.dtype = dtype
        self.num_aux = len(m["aux_layer_ids"])
        self._sha = {sh["path"]: sh["sha256"] for sh in m["shards"]}
        rows = []  # (sample_id, shard path, offset, length)
        for r in range(m["world_size"]):
            for sh in read_json(rank_dir(self.dir, r) / INDEX)["shards"]:
                rows += [(sid, f"{rank_dir(self.dir, r).name}/{sh['name']}", off, n) for sid, off, n in sh["samples"]]
        rows.sort()
        self.sample_ids = [r[0] for r in rows]
        self._loc = [r[1:] for r in rows]
        self.lengths = [r[3] for r in rows]
        self._open: OrderedDict[str, object] = OrderedDict()
        self._verified: set[str] = set()
        self.max_open = max_open_shards

    def __len__(self) -> int:
        return len(self._loc)

    def check_compatible(self, cfg) -> None:
        """Refuse (ValueError) a store captured from another target / layer ids / sizes than ``cfg``."""
        m, t = self.manifest, cfg.target
        want = {"target.name_or_path": t.name_or_path, "target.revision": t.revision,
                "target.num_hidden_layers": t.num_hidden_layers, "target.hidden_size": t.hidden_size,
                "target.vocab_size": t.vocab_size, "drafter.aux_layer_ids": list(cfg.aux_layer_ids())}
        have = {"target.name_or_path": m["target"]["name_or_path"], "target.revision": m["target"]["revision"],
                "target.num_hidden_layers": m["num_hidden_layers"], "target.hidden_size": m["hidden_size"],
                "target.vocab_size": m["vocab_size"], "drafter.aux_layer_ids": m["aux_layer_ids"]}
        for key, v in want.items():
            if key in ("target.num_hidden_layers", "target.hidden_size", "target.vocab_size") and not v:
                continue  # not written in the recipe: nothing to compare
            if have[key] != v:
                raise ValueError(f"feature store {self.dir} was captured with {key}={have[key]!r} but the "
                                 f"config has {key}={v!r}; capture again (run.force=[capture]) or fix {key}")

    def _shard(self, path: str):
        from safetensors import safe_open

        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        full = self.dir / path
        if path not in self._verified:
            if not full.exists():
                raise ValueError(f"feature shard {full} is missing; capture again (run.force=[capture])")
            if sha256_file(full) != self._sha[path]:
                raise ValueError(f"feature shard {full} fails its sha256 checksum (corrupt or modified); "
                                 f"capture again (run.force=[capture])")
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


class BatchIterator:
    """Seeded, rank-sharded packing of samples into batches, with an exactly resumable position.

    Epoch e shuffles all samples with ``seed + e``; rank r takes every world-th of them; plan_rows packs
    them into rows of ``row_tokens`` and rows are grouped ``rows_per_batch`` at a time. Every rank keeps
    the same number of batches (the minimum over ranks, computed locally from the lengths) so no rank
    waits on a collective the others skipped. Iterating runs the current epoch from the saved position,
    then moves the position to the next epoch. Subclasses implement ``fetch(indices) -> list[dict]``."""

    def __init__(self, lengths: list[int], rank: int, world: int, row_tokens: int, rows_per_batch: int, seed: int):
        self.lengths, self.rank, self.world = list(lengths), rank, world
        self.row_tokens, self.rows_per_batch, self.seed = row_tokens, rows_per_batch, seed
        self.epoch, self.position = 0, 0
        self._plan_cache: tuple[int, list] | None = None

    def fetch(self, indices: list[int]) -> list[dict]:
        raise NotImplementedError

    def _rank_batches(self, epoch: int, rank: int) -> list[list[list[int]]]:
        from data.packing import plan_rows

        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()[rank::self.world]
        rows = plan_rows([self.lengths[i] for i in order], self.row_tokens, self.seed + epoch)
        rows = [[order[j] for j in row] for row in rows]
        return [rows[i:i + self.rows_per_batch] for i in range(0, len(rows), self.rows_per_batch)]

    def epoch_plan(self, epoch: int) -> list[list[list[int]]]:
        """This rank's batches of epoch ``epoch``: a list of batches, each a list of rows of sample indices."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            n = min(len(self._rank_batches(epoch, r)) for r in range(self.world))
            self._plan_cache = (epoch, self._rank_batches(epoch, self.rank)[:n])
        return self._plan_cache[1]

    def __len__(self) -> int:
        return len(self.epoch_plan(self.epoch))

    def __iter__(self) -> Iterator[FeatureBatch]:
        from data.packing import collate

        plan = self.epoch_plan(self.epoch)
        while self.position < len(plan):
            rows = plan[self.position]
            flat = self.fetch([i for row in rows for i in row])
            it = iter(flat)
            samples = [[next(it) for _ in row] for row in rows]
            self.position += 1
            yield collate(samples, self.row_tokens)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class FeatureLoader(BatchIterator):
    """FeatureBatch iterator over an offline store (see BatchIterator for order and resumption)."""

    def __init__(self, store_dir: str | Path, rank: int, world: int, row_tokens: int, rows_per_batch: int,
                 seed: int, cfg=None, dtype: torch.dtype = torch.bfloat16):
        self.store = FeatureStore(store_dir, dtype=dtype)
        if cfg is not None:
            self.store.check_compatible(cfg)
        super().__init__(self.store.lengths, rank, world, row_tokens, rows_per_batch, seed)

    def fetch(self, indices: list[int]) -> list[dict]:
        return [self.store[i] for i in indices]


def open_store(store_dir: str | Path, cfg: Optional[object] = None) -> FeatureStore:
    """A FeatureStore, checked against ``cfg`` when given."""
    store = FeatureStore(store_dir)
    if cfg is not None:
        store.check_compatible(cfg)
    return store
