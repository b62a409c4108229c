"""``capture.mode=online`` with ``capture.engine=vllm``: a served target streams its states to the trainer.

Each trainer rank starts one vLLM engine in its own process (data/capture/vllm_side/capture_driver.py under
the engine's python, as offline capture does) and hands it, as one job, this rank's global batches of the
plan (data/features/reader.py BatchIterator) from the trainer's data position on: batch g, g + W, g + 2W, ...
The engine prefills each batch, writes its states into the rank's stream buffer
(``<run>/train/stream/rankNNNNN/<split>/spool/<split>``: fledge/run_layout.py owns ``train/stream``,
``EngineFeatureSource.spool`` the rest) and waits while ``capture.buffer_batches`` batches are unconsumed
there; the trainer waits (at most ``capture.engine_timeout_s``) for the batch it needs, turns its states
into the same per-sample tensors the offline store holds (the head Fledge computes beside the engine,
data/capture/engine.py ``sample_features``, then the store's own rounding), collates them into a
FeatureBatch and deletes the files. So backpressure runs both ways, the buffer holds at most
``buffer_batches`` batches, and nothing of a full store is written.

The data position is the contract: a resumed trainer seeks to its checkpoint's position and starts a fresh
engine from there (a killed run's unconsumed buffer is dropped), so no sample is lost or repeated. An
engine that dies is started again from the batch the trainer waits for, ``capture.engine_restarts`` times,
then the run fails with one line naming the engine's log. Every consumed batch is appended to
``<rank dir>/train-consumed.jsonl`` (global batch, sample ids): the record a resumed or restarted run
is checked against. The held-out set is streamed by a short-lived
engine of its own at each evaluation, which takes the training engine's place (``displaces``): on a GPU both would
ask for 0.85 of the same device's memory, and under a launcher the evaluation's srun could not get the node the
training engine holds. So the leader stops its training engine before an evaluation starts its own, and the next
training batch starts it again at the data position (an evaluation runs between optimizer steps, so at a step's
start, where a restarted shared engine begins anyway).

SIGTERM ends every wait for a batch at once (``stop_requested``, the trainer's flag, set by ``stop_when``):
``StreamInterrupted``, and no engine is started after it. Under Slurm the engines get the job's SIGTERM too;
restarting one and waiting for it to load would outlast the grace the trainer has to checkpoint. The trainer takes
it as a step boundary (train/trainer.py).

On a cluster the engines run on GPUs of their own: ``capture.engine_launcher`` is the command prefix each
engine's driver starts under (``srun --het-group=1 ...`` in the heterogeneous job of pipeline/slurm/submit.py;
the buffer is then on the shared file system, and the driver, whose parent is srun, watches its rank's
heartbeat file to end itself when the rank is gone), and ``capture.ranks_per_engine`` = k lets one engine
(TP GPUs: a 1T target does not fit one per rank) serve k consecutive ranks: the group's first rank starts it,
with the group's batches interleaved in the order they are consumed and each written, keyed by its global
batch, into the consuming rank's spool. A restarted shared engine begins at the start of the leader's
optimizer step, since a member may still wait for a batch made before the leader's; each rank drops the
keys below the one it waits for, so a batch made twice is read once. Once the leader has its step's last batch,
it waits for the engine to have made the members' batches of the step too (the driver's progress note), and
restarts a dead engine there: otherwise the leader, its step in hand, would sit in the step's all-reduce while a
member waited on an engine nobody restarts.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
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
from fledge.data.features.source import StreamInterrupted
from fledge.data.features.store import decode_aux, encode_sample
from fledge.engine_process import keep_log

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
    workdir: Path  # this rank's stream directory (its siblings rankNNNNN are the other ranks')
    env: dict
    timeout_s: float
    buffer_batches: int
    restarts: int
    device: torch.device
    launcher: tuple[str, ...] = ()  # capture.engine_launcher: the command prefix the engine starts under
    ranks_per_engine: int = 1  # capture.ranks_per_engine: consecutive ranks one engine serves
    grad_accum: int = 1  # global batches of a rank per optimizer step (a shared engine restarts at a step start)
    tensor_parallel_size: int = 1  # capture.tensor_parallel_size: the engine's GPUs (its env lists them)
    expert_parallel: bool = False  # capture.expert_parallel: MoE experts over those GPUs


EVAL_KEY = 10_000_000  # the k-th evaluation's batches are keyed k * EVAL_KEY + g: keys grow in every spool


class EngineFeatureSource(BatchIterator):
    """The trainer's FeatureBatch stream from a vLLM engine (see the module docstring); ``end``: the global
    batch the run stops before (the engine's job runs to there; a trainer that asks for more restarts it), as
    the trainer sets it with ``seek`` from its resume position and the run's length (default: one epoch).

    Ranks ``leader .. leader + ranks_per_engine - 1`` share one engine, started by the leader: its job
    interleaves the group's batches in the order they are consumed (g, g + 1, ... for each of the leader's g)
    and writes each into the consuming rank's spool, keyed by global batch. Every rank reads its own spool
    by key and drops keys below the one it waits for (batches a restarted engine made again).

    ``displaces``: the source whose engine this one's evaluations take the place of (the held-out split's, the
    training split's). ``stop_requested``: the trainer's SIGTERM flag (``stop_when`` sets it); once true, a wait for a
    batch raises StreamInterrupted and no engine is started."""

    def __init__(self, dataset_dir: str | Path, spec: StreamSpec, rank: int, world: int, row_tokens: int,
                 rows_per_batch: int, seed: int, end: int | None = None, name: str = "train",
                 displaces: EngineFeatureSource | None = None):
        from datasets import load_from_disk

        from fledge.data.capture.offline import dataset_lengths

        self.ds = load_from_disk(str(dataset_dir))
        self.spec, self.name, self.displaces = spec, name, displaces
        self.stop_requested: Callable[[], bool] = lambda: False
        super().__init__(dataset_lengths(self.ds), rank, world, row_tokens, rows_per_batch, seed)
        k = spec.ranks_per_engine
        if world % k:
            raise ValueError(f"capture.ranks_per_engine={k}: must divide the data-parallel world size ({world})")
        self.leader, self.members = rank - rank % k, list(range(rank - rank % k, rank - rank % k + k))
        # A killed run's unconsumed batches go: they would hold back-pressure room the new engine needs. Every
        # rank clears its own spool before any engine starts (data/capture/sources.py waits for all of them).
        shutil.rmtree(self.spool(rank), ignore_errors=True)
        self.end = end if end is not None else self.global_batches_per_epoch
        self.eng_ids = engine_layer_ids(spec.aux_layer_ids, spec.num_layers)
        self.head: TargetHead | None = None
        self._run: EngineRun | None = None
        self._next_g: int | None = None
        self._made_by: dict[int, int] = {}
        self._steps_from = 0  # the global batch the trainer's optimizer steps count from (its resume position)
        self._restarts_left = spec.restarts
        self._evals = 0
        self.wait_s = 0.0  # trainer time spent waiting on the engine (the stall, for scripts/bench_online.py)
        self.engine_starts = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def spool(self, rank: int) -> Path:
        """Where rank ``rank``'s batches of this split land (the leader's engine writes every member's)."""
        # absolute: the engine's driver runs in a directory of its own (a relative path would land under it)
        base = Path(self.spec.workdir).resolve()  # this rank's (a data-parallel rank's under sequence parallelism)
        if rank != self.rank:
            base = base.parent / f"rank{rank:05d}"  # a member's: shared engines run without sequence parallelism
        return base / self.name / "spool" / self.name

    # -- the engine (the leader's) ------------------------------------------------------------------------

    def _samples_of(self, g: int) -> list[int]:
        epoch, i = divmod(g, self.global_batches_per_epoch)
        return [j for row in self.global_plan(epoch)[i] for j in row]

    def _start(self, order: list[tuple[int, int, int]], name: str) -> EngineRun:
        """The leader's engine for ``order``: (global batch whose samples to run, its file key, member index), in
        the order the group consumes them."""
        s = self.spec
        work = Path(s.workdir) / name
        job = write_job(name, self.ds, [self._samples_of(g) for g, _, _ in order], work)
        job.update(spools=[str(self.spool(m)) for m in self.members], spool_of=[i for _, _, i in order],
                   keys=[key for _, key, _ in order])
        longest = max((n for b in job["batches"] for _, _, n in b), default=1)
        req = build_request(s.target, s.revision, s.trust_remote_code, str(s.dtype).replace("torch.", ""),
                            longest + 1, self.eng_ids, s.tensor_parallel_size, s.expert_parallel, 1, s.env, work, [job],
                            max_pending_batches=s.buffer_batches)
        self.engine_starts += 1
        return EngineRun(s.python, req, work, s.timeout_s, list(s.launcher))

    def _open(self, g: int) -> None:
        """Start the group's engine at the leader's global batch ``g``, to the end of the run."""
        self.close()
        ks = range(len(self.members))
        order = [(h + i, h + i, i) for h in range(g, max(self.end, g + 1), self.world) for i in ks
                 if h + i < max(self.end, g + 1)]
        self._run = self._start(order, self.name)
        self._next_g = g
        self._made_by = {key: n + 1 for n, (_, key, _) in enumerate(order)}  # key -> the job's batches made with it

    def _restart_point(self, g: int) -> int:
        """Where a restarted engine begins: at ``g`` for an engine of its own; for a shared one, at the start
        of the leader's optimizer step, since a member may still wait for a batch made before the leader's. Steps
        start at the resume position and every grad_accum rounds after it (not at multiples of the step size:
        a run resumed after a change of grad_accum or world size)."""
        if self.spec.ranks_per_engine == 1:
            return g
        return g - (g - self._steps_from) // self.world % self.spec.grad_accum * self.world

    def _await_members(self, g: int) -> None:
        """The leader, holding its last batch ``g`` of a step: wait until the engine has made the members' batches
        of the step too (they come after g), so no member waits on an engine that died after the leader's batch
        while the leader waits for it in the step's collectives (a ValueError from a dead engine restarts it)."""
        last = g + len(self.members) - 1
        if not self.is_leader or last == g or (g - self._steps_from) // self.world % self.spec.grad_accum != \
                self.spec.grad_accum - 1 or last not in self._made_by:
            return
        what = f"global batch {last} (rank {self.rank + last - g}'s)"
        if not self._run.wait_made(self.name, self._made_by[last], what, stop=self.stop_requested):
            self._interrupted(what)

    def _interrupted(self, what: str) -> None:
        raise StreamInterrupted(f"rank {self.rank}: SIGTERM while waiting for {what}")

    def seek(self, position: int, end: int | None = None) -> None:
        super().seek(position, end)
        self._steps_from = self.position

    def stop_when(self, stopping: Callable[[], bool]) -> None:
        self.stop_requested = stopping

    def stats(self) -> dict[str, float | int]:
        return {"engine_wait_s": round(self.wait_s, 3), "engine_starts": self.engine_starts}

    # -- reading a rank's spool ---------------------------------------------------------------------------

    def _read(self, key: int, samples: list[int], what: str) -> list:
        """The engine's [(sample id, its file's tensors, sampled token)] for batch ``key`` of this rank's spool, waiting
        for it (bounded) and deleting its files; stale keys below it are dropped on the way."""
        from safetensors.torch import load_file

        spool, s = self.spool(self.rank), self.spec
        done = spool / f"batch-{key:07d}.json"
        waited = s.timeout_s * (1 + s.restarts) if self._run is None else s.timeout_s
        deadline = time.monotonic() + waited
        while True:
            self._drop_stale(spool, key)
            try:
                got = json.loads(done.read_text())["samples"]
                out = [(sid, load_file(str(spool / f"{key:07d}-{sid}.safetensors")), int(tok)) for sid, tok in got]
                break
            except FileNotFoundError:  # not written yet, or being made again by a restarted engine
                pass
            if self.stop_requested():
                self._interrupted(what)
            if self._run is not None:
                self._run.check(done, what, deadline)
            elif time.monotonic() > deadline:
                raise ValueError(f"capture.engine=vllm: rank {self.rank} waited {waited:g} s (capture.engine_timeout_s "
                                 f"x (1 + capture.engine_restarts)) for {what} from the engine of rank {self.leader} "
                                 f"(capture.ranks_per_engine={s.ranks_per_engine}); see its log, "
                                 f"{self.spool(self.leader).parents[1] / 'engine.log'}")
            time.sleep(0.02)
        if [sid for sid, _, _ in out] != samples:
            raise ValueError(f"{s.workdir}: the engine streamed samples {[x for x, _, _ in out][:8]} for {what}, "
                             f"which holds {samples[:8]}; another run is using this run directory")
        for sid, _, _ in out:
            (spool / f"{key:07d}-{sid}.safetensors").unlink(missing_ok=True)
        done.unlink(missing_ok=True)
        return out

    @staticmethod
    def _drop_stale(spool: Path, key: int) -> None:
        for old in spool.glob("batch-*.json"):
            k = int(old.stem.split("-")[1])
            if k < key:
                for f in spool.glob(f"{k:07d}-*.safetensors"):
                    f.unlink(missing_ok=True)
                old.unlink(missing_ok=True)

    def _features(self, got: list) -> list[dict]:
        """The engine's files of one batch -> the per-sample tensors the offline store would hold."""
        rows = self.ds.select([sid for sid, _, _ in got])
        out, n_aux, s = [], len(self.spec.aux_layer_ids), self.spec
        for (sid, files, sampled), row in zip(got, rows):
            if files["token_ids"].tolist() != list(row["input_ids"]):
                raise ValueError(f"{s.workdir}: the engine's hidden states for sample {sid} belong to other tokens; "
                                 "another run is using this run directory")
            states = files["hidden_states"]
            aux, final, argmax = sample_features(self.head, states, self.eng_ids, s.aux_layer_ids, s.num_layers, row,
                                                 sampled, sid, s.dtype, s.device, self.head.argmax_chunk())
            # the store's rounding, so online and offline training see the very same numbers
            e = encode_sample(row["input_ids"], row["loss_mask"], aux, final, argmax, n_aux, s.aux_dtype)
            out.append({"input_ids": e["input_ids"].long(), "loss_mask": e["loss_mask"].bool(),
                        "aux_hidden": decode_aux(e["aux_hidden"], e.get("aux_scale"), n_aux, s.feature_dtype),
                        "target_hidden": e["target_hidden"].to(s.feature_dtype),
                        "target_argmax": e["target_argmax"].long()})
        return out

    def _head(self) -> TargetHead:
        s = self.spec
        if self.head is None:
            self.head = TargetHead.load(s.target, s.revision, s.rms_norm_eps, s.device, s.dtype)
        return self.head

    def _next_from_engine(self, g: int) -> list[dict]:
        self._head()
        samples, what = self._samples_of(g), f"global batch {g}"
        while True:
            if self.is_leader and (self._run is None or self._next_g != g):
                if self.stop_requested():
                    self._interrupted(what)
                self._open(g)
            t0 = time.perf_counter()
            try:
                got = self._read(g, samples, what)
                self._await_members(g)
            except ValueError as e:
                if self.stop_requested():  # the job's SIGTERM ended the engine too: no restart
                    self.close()
                    raise StreamInterrupted(f"rank {self.rank}: SIGTERM while waiting for {what}") from e
                dead = self._run is not None and self._run.proc.returncode is not None
                if not dead or self._restarts_left <= 0:
                    self.close()
                    raise
                self._restarts_left -= 1
                dead_log = self._run.log_path
                self.close()
                log.warning("capture.engine=vllm: the engine died (%s); its log is kept as %s; starting it again at "
                            "global batch %d (%d restarts left, capture.engine_restarts)",
                            str(e).splitlines()[0][:300], keep_log(dead_log), self._restart_point(g),
                            self._restarts_left)
                self._open(self._restart_point(g))
                self._next_g = g
                continue
            finally:
                self.wait_s += time.perf_counter() - t0
            self._next_g = g + self.world
            out = self._features(got)
            with open(Path(self.spec.workdir) / f"{self.name}-consumed.jsonl", "a") as f:  # the fault tests' record
                f.write(json.dumps({"batch": g, "samples": samples}) + "\n")
            return out

    # -- BatchIterator ------------------------------------------------------------------------------------

    def fetch(self, indices: list[int]) -> list[dict]:
        raise NotImplementedError("EngineFeatureSource streams whole global batches (next_batch / eval_batches)")

    def batch_at(self, g: int):
        rows = self.global_plan(g // self.global_batches_per_epoch)[g % self.global_batches_per_epoch]
        flat = iter(self._next_from_engine(g))
        return collate([[next(flat) for _ in row] for row in rows], self.row_tokens)

    def eval_batches(self, n: int):
        """The held-out share of BatchIterator.eval_batches, through an engine of its own for this evaluation
        (the leader's, for its group, in the place of ``displaces``'s); a pad batch (g >= n) runs batch 0 again and
        is marked so."""
        self._head()
        n = min(n, self.global_batches_per_epoch)
        padded = -(-n // self.world) * self.world
        base = self._evals * EVAL_KEY
        self._evals += 1
        run = None
        if self.is_leader:
            order = [(g if g < n else 0, base + g, i) for j in range(0, padded, self.world)
                     for i, g in enumerate(range(j + self.leader, j + self.leader + len(self.members)))]
            if self.stop_requested():
                self._interrupted("the held-out set")
            if self.displaces is not None:  # its engine gives up the GPUs; its next batch starts it again
                self.displaces.close()
            run = self._start(order, self.name)
        saved, self._run = self._run, run
        try:
            for g in range(self.rank, padded, self.world):
                src = g if g < n else 0
                got = self._read(base + g, self._samples_of(src), f"held-out batch {g}")
                rows = self.global_plan(0)[src]
                flat = iter(self._features(got))
                yield collate([[next(flat) for _ in row] for row in rows], self.row_tokens), g < n
            if run is not None:
                run.finish()
        finally:
            self._run = saved
            if run is not None:
                run.close()

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
        self._run, self._next_g = None, None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
