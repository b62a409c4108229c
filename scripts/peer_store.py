"""A Fledge capture in vLLM speculators' offline format (scripts/compare_peer.py's stage 1): the peer trains on the
same rows and target states without a vLLM server of its own.

Fledge's store (data/features/store.py, read here from its files only) holds per token the aux states at the boundary
ids, the target's final *normed* state and its full-vocab argmax. The peer (speculators/train/data.py ``ArrowDataset``
with hs_connectors' ``FileTransfer``) reads an Arrow dataset of rows (``input_ids``, ``loss_mask``, ``seq_len``) and,
for row i, ``hidden_states/hs_<i>.safetensors`` = ``{"hidden_states": [T, n+1, H], "token_ids": [T]}``: the n aux
states then the last layer's output *before* the final norm, which it normalises itself (``verifier_norm``, the
target's weight). So the last slot is the normed state divided by the norm weight: RMSNorm of it gives the stored
state back up to eps, and the argmax the peer's teacher takes agrees with Fledge's ``target_argmax`` (checked on the
first rows; the rest of the gap is the bf16 the store keeps the state in, which Fledge's own trainer sees too).
Written in float32, so the aux states pass unchanged. The eval split's rows follow the train rows, and the peer's
``--train-data-ratio`` cuts exactly there, so its validation split is Fledge's held-out split (its default would
hold out 10% of the train rows); ``heldout.safetensors`` keeps their full-vocab argmax for the scorer. The draft
vocabulary is the prepare stage's, as ``d2t.npy`` / ``t2d.npy`` (offsets and a mask, the peer's convention too:
without them it would silently train on the full vocabulary).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CHECK_TOKENS = 4096  # tokens of the first train rows whose argmax agreement is checked
MIN_AGREEMENT = 0.99  # below it the un-normed state is not the target's: refused


class StoreError(ValueError):
    """The run's capture cannot be converted (one line)."""


def read_store(store_dir: Path) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Every sample of a complete store as (sample id, {input_ids, loss_mask, aux [T, n, H] float32, normed [T, H]
    float32, argmax [T]}), shard by shard."""
    manifest = json.loads((store_dir / "store.json").read_text()) if (store_dir / "store.json").exists() else {}
    if not manifest.get("complete"):
        raise StoreError(f"{store_dir}: no complete feature store (store.json); finish the capture stage first")
    n = len(manifest["aux_layer_ids"])
    for part in manifest["indexes"]:
        for shard in json.loads((store_dir / part / "index.json").read_text())["shards"]:
            t = load_file(str(store_dir / part / shard["name"]))
            for sid, offset, length in shard["samples"]:
                s = slice(offset, offset + length)
                aux = t["aux_hidden"][s].float().reshape(length, n, -1)
                if "aux_scale" in t:  # fp8: one scale per token and aux layer
                    aux = aux * t["aux_scale"][s].float().unsqueeze(-1)
                yield sid, {"input_ids": t["input_ids"][s].long(), "loss_mask": t["loss_mask"][s].long(), "aux": aux,
                            "normed": t["target_hidden"][s].float(), "argmax": t["target_argmax"][s].long()}


def target_head(target_dir: Path) -> tuple[torch.Tensor, float, torch.Tensor]:
    """The target's final norm weight, its eps and its lm_head (the embedding when tied), from its own files."""
    config = json.loads((target_dir / "config.json").read_text())
    config = config.get("text_config", config)
    tensors = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
                if key in f.keys():
                    tensors[key] = f.get_tensor(key).float()
    head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    if "model.norm.weight" not in tensors or head is None:
        raise StoreError(f"{target_dir}: no model.norm.weight / lm_head in its safetensors files (a Llama-style "
                         "target is what this conversion knows)")
    w = tensors["model.norm.weight"]
    if bool((w.abs() < 1e-6).any()):
        raise StoreError(f"{target_dir}: the final norm weight has zeros, so the state before it cannot be recovered")
    return w, float(config.get("rms_norm_eps", 1e-6)), head


def peer_sample(sample: dict, norm_w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One row's ``hs_<i>.safetensors``: the aux states and the un-normed last state, float32."""
    last = (sample["normed"] / norm_w).unsqueeze(1)
    return {"hidden_states": torch.cat([sample["aux"], last], 1).contiguous(), "token_ids": sample["input_ids"]}


def peer_argmax(hidden_states: torch.Tensor, norm_w: torch.Tensor, eps: float, head: torch.Tensor) -> torch.Tensor:
    """The argmax the peer's teacher takes from the last slot: RMSNorm with the target's weight, then lm_head."""
    y = hidden_states[:, -1]
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return torch.cat([(c @ head.T).argmax(-1) for c in y.split(512)])


def write_atomic(tensors: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def convert_split(store_dir: Path, hs_dir: Path, first: int, head: tuple, check: dict, label: str) -> list[dict]:
    """Write a store's rows as hs_<first + sample id>.safetensors (a row already written is kept) and return the
    rows {input_ids, loss_mask, argmax} in sample order; the first rows' argmax agreement is added to ``check``."""
    rows, t0, shown = {}, time.time(), time.time()
    for sid, s in read_store(store_dir):
        path = hs_dir / f"hs_{first + sid}.safetensors"
        hs = peer_sample(s, head[0])
        if check["tokens"] < CHECK_TOKENS:
            check["tokens"] += len(s["argmax"])
            check["agree"] += int((peer_argmax(hs["hidden_states"], *head) == s["argmax"]).sum())
        if not path.exists():
            write_atomic(hs, path)
        rows[sid] = {"input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].tolist(), "argmax": s["argmax"]}
        if time.time() - shown > 5:
            shown = time.time()
            print(f"[convert] {label}: {len(rows)} rows, {time.time() - t0:.0f} s", flush=True)
    if sorted(rows) != list(range(len(rows))):
        raise StoreError(f"{store_dir}: sample ids are not 0..{len(rows) - 1}")
    return [rows[i] for i in range(len(rows))]


def convert_run(run: Path, out: Path) -> dict:
    """Stage 1 of compare_peer.py: RUN's train and eval stores under ``out`` (skipped when ``conversion.json``
    names the same capture). Returns that record: the paths and counts the peer's plan needs."""
    from fledge.run_layout import RunLayout

    layout, record = RunLayout(run), out / "conversion.json"
    capture = json.loads(layout.manifest("capture").read_text())
    if record.exists() and json.loads(record.read_text())["capture_output_id"] == capture.get("output_id"):
        print(f"[convert] kept ({record})", flush=True)
        return json.loads(record.read_text())
    stores = {split: Path(p).parent for split, p in capture["outputs"]["store"].items()}
    if "eval" not in stores:
        raise StoreError(f"{run}: the capture has no eval store, which is the held-out split the peer validates on")
    meta = json.loads((stores["train"] / "store.json").read_text())
    target_dir = Path(meta["target"]["name_or_path"])
    head = target_head(target_dir.resolve())  # a relative path is the working directory's, as for Fledge
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    check = {"tokens": 0, "agree": 0}
    train = convert_split(stores["train"], out / "hidden_states", 0, head, check, "train")
    agreement = check["agree"] / max(1, check["tokens"])
    if agreement < MIN_AGREEMENT:
        raise StoreError(f"the un-normed last state gives the target's argmax on {agreement:.2%} of the first "
                         f"{check['tokens']} tokens (< {MIN_AGREEMENT:.0%}): not the state before the final norm")
    held = convert_split(stores["eval"], out / "hidden_states", len(train), head, {"tokens": CHECK_TOKENS}, "eval")
    write_rows(train + held, out / "rows")
    save_file({str(len(train) + i): r["argmax"] for i, r in enumerate(held)}, str(out / "heldout.safetensors"))
    vocab = load_file(str(layout.prepare.vocab))
    np.save(out / "d2t.npy", vocab["d2t"].long().numpy())
    np.save(out / "t2d.npy", vocab["t2d"].bool().numpy())
    n = len(train) + len(held)
    data = {"capture_output_id": capture.get("output_id"), "rows": str(out / "rows"),
            "hidden_states": str(out / "hidden_states"), "d2t": str(out / "d2t.npy"), "t2d": str(out / "t2d.npy"),
            "heldout": str(out / "heldout.safetensors"), "train_rows": len(train), "eval_rows": len(held),
            "train_tokens": sum(len(r["input_ids"]) for r in train),
            "eval_tokens": sum(len(r["input_ids"]) for r in held),
            # the peer cuts its validation split at int(rows * ratio): exactly the train rows
            "train_data_ratio": (len(train) + 0.5) / n, "target_layer_ids": meta["aux_layer_ids"],
            "draft_vocab_size": int(vocab["d2t"].numel()), "argmax_agreement": agreement,
            "argmax_checked_tokens": check["tokens"]}
    record.write_text(json.dumps(data, indent=1))
    return data


def write_rows(rows: list[dict], path: Path) -> None:
    """The peer's Arrow dataset of rows (as its preprocessing saves it: torch format)."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
                            "seq_len": [len(r["input_ids"]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))


def machine() -> str:
    """The CPU (and its widest matrix ISA), the core count and the GPU if any."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
               platform.processor())
    isa = "AMX" if "amx_bf16" in info else "AVX-512" if "avx512f" in info else "AVX2"
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu} ({isa}), {os.cpu_count()} cores{gpu}"
