"""``capture.mode=online`` with ``capture.engine=vllm``: a served target streams its states to the trainer.

Each trainer rank starts one vLLM engine in its own process (data/capture/vllm_side/capture_driver.py under
the engine's python, as offline capture does) and hands it, as one job, this rank's global batches of the
plan (data/features/reader.py BatchIterator) from the trainer's data position on: batch g, g + W, g + 2W, ...
The engine prefills each batch, writes its states into the rank's stream buffer
(``<run>/train/stream/rankNNNNN/spool``, fledge/run_layout.py) and waits while ``capture.buffer_batches``
batches are unconsumed there; the trainer waits (at most ``capture.engine_timeout_s``) for the batch it
needs, turns its states into the same per-sample tensors the offline store holds (the head Fledge computes
beside the engine, data/capture/engine.py ``sample_features``, then the store's own rounding), collates them
into a FeatureBatch and deletes the files. So backpressure runs both ways, the buffer holds at most
``buffer_batches`` batches, and nothing of a full store is written.

The data position is the contract: a resumed trainer seeks to its checkpoint's position and starts a fresh
engine from there (a killed run's unconsumed buffer is dropped), so no sample is lost or repeated. An
engine that dies is started again from the batch the trainer waits for, ``capture.engine_restarts`` times,
then the run fails with one line naming the engine's log. Every consumed batch is appended to
``<rank dir>/train-consumed.jsonl`` (global batch, sample ids): the record a resumed or restarted run
is checked against. The held-out set is streamed by a short-lived
engine of its own at each evaluation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fledge.data.capture.engine import (
    EngineRun,
    TargetHead,
    build_request,
    engine_layer_ids,
    sample_features,
    write_job,
)
from fledge.data.features.packing import collate
from fledge.data.features.reader import BatchIterator
from fledge.data.features.store import decode_aux, encode_sample

log = logging.getLogger(__name__)


@dataclass
class StreamSpec:
    """What a rank's engine runs and where: the target, its layers, the engine settings, the buffer."""

    python: Path
    target: str
    revision: str | None
    trust_remote_code: bool
    dtype: torch.dtype  # the engine's and the head's compute dtype
    feature_dtype: torch.dtype  # the trainer's: float features are decoded to it, as FeatureLoader does
    aux_layer_ids: list[int]
    num_layers: int
    rms_norm_eps: float
    aux_dtype: str  # capture.dtype: the features are rounded as the offline store rounds them
    workdir: Path  # this rank's stream directory
    env: dict
    timeout_s: float
    buffer_batches: int
    restarts: int
    device: torch.device


class EngineFeatureSource(BatchIterator):
    """The trainer's FeatureBatch stream from a vLLM engine (see the module docstring); ``end``: the global
    batch the run stops before (the engine's job runs to there; a trainer that asks for more restarts it)."""

    def __init__(self, dataset_dir: str | Path, spec: StreamSpec, rank: int, world: int, row_tokens: int,
                 rows_per_batch: int, seed: int, end: int | None = None, name: str = "train"):
        from datasets import load_from_disk

        from fledge.data.capture.offline import dataset_lengths

        self.ds = load_from_disk(str(dataset_dir))
        self.spec, self.name = spec, name
        super().__init__(dataset_lengths(self.ds), rank, world, row_tokens, rows_per_batch, seed)
        self.end = end if end is not None else self.global_batches_per_epoch
        self.eng_ids = engine_layer_ids(spec.aux_layer_ids, spec.num_layers)
        self.head: TargetHead | None = None
        self._run: EngineRun | None = None
        self._stream = None
        self._next_g: int | None = None
        self._restarts_left = spec.restarts
        self.wait_s = 0.0  # trainer time spent waiting on the engine (the stall, for scripts/bench_online.py)
        self.engine_starts = 0

    # -- the engine ---------------------------------------------------------------------------------------

    def _samples_of(self, g: int) -> list[int]:
        epoch, i = divmod(g, self.global_batches_per_epoch)
        return [j for row in self.global_plan(epoch)[i] for j in row]

    def _start(self, gs: list[int], name: str) -> tuple[EngineRun, dict]:
        s = self.spec
        if self.head is None:
            self.head = TargetHead.load(s.target, s.revision, s.rms_norm_eps, s.device, s.dtype)
        work = Path(s.workdir) / name
        job = write_job(name, self.ds, [self._samples_of(g) for g in gs], work)
        longest = max((n for b in job["batches"] for _, _, n in b), default=1)
        req = build_request(s.target, s.revision, s.trust_remote_code, str(s.dtype).replace("torch.", ""),
                            longest + 1, self.eng_ids, 1, False, 1, s.env, work, [job],
                            max_pending_batches=s.buffer_batches)
        self.engine_starts += 1
        return EngineRun(s.python, req, work, s.timeout_s), job

    def _open(self, g: int) -> None:
        self.close()
        gs = list(range(g, max(self.end, g + 1), self.world))
        self._run, job = self._start(gs, self.name)
        self._stream = self._run.batches(job)
        self._next_g = g

    def _features(self, got: list, g: int) -> list[dict]:
        want = self._samples_of(g)
        if [sid for sid, _, _ in got] != want:
            raise ValueError(f"{self.spec.workdir}: the engine streamed samples {[s for s, _, _ in got][:8]} for "
                             f"global batch {g}, which holds {want[:8]}; another run is using this run directory")
        rows = self.ds.select(want)
        out, n_aux, s = [], len(self.spec.aux_layer_ids), self.spec
        for (sid, states, sampled), row in zip(got, rows):
            aux, final, argmax = sample_features(self.head, states, self.eng_ids, s.aux_layer_ids, s.num_layers, row,
                                                 sampled, sid, s.dtype, s.device, self.head.argmax_chunk())
            # the store's rounding, so online and offline training see the very same numbers
            e = encode_sample(row["input_ids"], row["loss_mask"], aux, final, argmax, n_aux, s.aux_dtype)
            out.append({"input_ids": e["input_ids"].long(), "loss_mask": e["loss_mask"].bool(),
                        "aux_hidden": decode_aux(e["aux_hidden"], e.get("aux_scale"), n_aux, s.feature_dtype),
                        "target_hidden": e["target_hidden"].to(s.feature_dtype),
                        "target_argmax": e["target_argmax"].long()})
        return out

    def _next_from_engine(self, g: int) -> list[dict]:
        while True:
            if self._run is None or self._next_g != g:
                self._open(g)
            t0 = time.perf_counter()
            try:
                got = next(self._stream)
            except (ValueError, StopIteration) as e:
                dead, log_path = self._run.proc.returncode is not None, self._run.log_path
                if not dead or self._restarts_left <= 0:
                    self.close()
                    if isinstance(e, StopIteration):
                        raise ValueError(f"capture.engine=vllm: the engine's stream ended before global batch {g}; "
                                         f"see {log_path}") from None
                    raise
                self._restarts_left -= 1
                log.warning("capture.engine=vllm: the engine died before global batch %d (%s); starting it again "
                            "from there (%d restarts left, capture.engine_restarts)", g,
                            str(e).splitlines()[0][:300], self._restarts_left)
                self.close()
                continue
            finally:
                self.wait_s += time.perf_counter() - t0
            self._next_g = g + self.world
            out = self._features(got, g)
            with open(Path(self.spec.workdir) / f"{self.name}-consumed.jsonl", "a") as f:  # the fault tests' record
                f.write(json.dumps({"batch": g, "samples": self._samples_of(g)}) + "\n")
            return out

    # -- BatchIterator ------------------------------------------------------------------------------------

    def fetch(self, indices: list[int]) -> list[dict]:
        raise NotImplementedError("EngineFeatureSource streams whole global batches (next_batch / eval_batches)")

    def batch_at(self, g: int):
        rows = self.global_plan(g // self.global_batches_per_epoch)[g % self.global_batches_per_epoch]
        flat = iter(self._next_from_engine(g))
        return collate([[next(flat) for _ in row] for row in rows], self.row_tokens)

    def eval_batches(self, n: int):
        """The held-out share of BatchIterator.eval_batches, through an engine of its own for this evaluation."""
        n = min(n, self.global_batches_per_epoch)
        gs = list(range(self.rank, -(-n // self.world) * self.world, self.world))
        mine = [g if g < n else 0 for g in gs]
        run, job = self._start(mine, self.name)
        try:
            for g, got in zip(gs, run.batches(job)):
                rows = self.global_plan(0)[g if g < n else 0]
                flat = iter(self._features(got, g if g < n else 0))
                yield collate([[next(flat) for _ in row] for row in rows], self.row_tokens), g < n
            run.finish()
        finally:
            run.close()

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
        self._run, self._stream, self._next_g = None, None, None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
