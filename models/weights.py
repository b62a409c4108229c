"""Reading safetensors weights, for the target and for exported drafters alike.

A *source* is a local directory or a Hugging Face Hub repo id (read through the Hub cache, so the target's
embedding and lm_head rows come without instantiating the target). ``weight_map`` is the one place that
reads ``model.safetensors.index.json``; everything else (headers, named tensors, the embedding, lm_head
rows) goes through it, opening only the shard files that hold what was asked for.

An index whose ``weight_map`` names a file outside its own directory (``../x.safetensors``, an absolute
path) is refused: a downloaded or hand-edited index must not make Fledge read (or, through the Hub cache,
fetch) files it was never pointed at.

The target's final norm, input embedding and lm_head are picked by structure, never by the shortest name:
they are the ones of the text decoder (``decoder_prefix``), which a vision tower, a projector or an MTP
module beside it cannot be (tests/fixtures/tensor_names/ holds the layouts this is tested on).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from fledge.models.families import text_config_dict

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A tensor inside a numbered decoder layer: DeepSeek-V3's MTP module keeps its own copies of the embedding
# (model.layers.61.embed_tokens.weight) and of the output head there, which are never the target's own.
_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def resolve_file(source: str | Path, filename: str, revision: str | None = None) -> Path | None:
    """``filename`` of a local directory or a Hub repo (downloaded into the Hub cache); None if absent."""
    p = Path(source)
    if p.is_dir():
        f = p / filename
        return f if f.exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(str(source), filename, revision=revision))
    except EntryNotFoundError:
        return None


def is_contained(entry: object) -> bool:
    """True when ``entry``, a path a file lists relative to its own directory, stays inside it: a non-empty
    relative POSIX path with no ``..`` part, no drive and no backslash."""
    # Such entries are relative POSIX names by convention (safetensors/HF indexes, the feature store's
    # manifests). The check is lexical on purpose: Hub-cache snapshots are symlinks into ../../blobs, so
    # resolving links would refuse them.
    ok = isinstance(entry, str) and entry and "\\" not in entry and not PureWindowsPath(entry).drive
    if ok:
        p = PurePosixPath(entry)
        ok = not p.is_absolute() and ".." not in p.parts
    return bool(ok)


def _check_contained(index: Path, shard: object) -> None:
    if not is_contained(shard):
        raise ValueError(f"{index}: weight_map entry {shard!r} points outside the index's directory; an index "
                         "may only name shard files next to it (re-save the checkpoint, or fix that entry)")


def weight_map(source: str | Path, revision: str | None = None) -> dict[str, str]:
    """{tensor name: shard file name} of a source: from its index when it has one, else every tensor of its
    single ``model.safetensors``. Raises ValueError when neither exists or the index is malformed."""
    index = resolve_file(source, INDEX, revision)
    if index is not None:
        try:
            wm = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e}); re-save the checkpoint") from None
        if not isinstance(wm, dict):
            raise ValueError(f"{index}: no weight_map object; re-save the checkpoint")
        for shard in set(wm.values()):
            _check_contained(index, shard)
        return dict(wm)
    single = resolve_file(source, SINGLE, revision)
    if single is None:
        raise ValueError(f"{source}: no {SINGLE} and no {INDEX}; Fledge reads safetensors weights only "
                         "(re-save the model with safe_serialization, or point at the exported directory)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: SINGLE for name in f.keys()}


def _by_shard(source, revision, names: Iterable[str] | None) -> dict[Path, list[str]]:
    """The shard files to open for ``names`` (all tensors when None), each with the names it holds."""
    wm = weight_map(source, revision)
    names = list(wm) if names is None else list(names)
    missing = [n for n in names if n not in wm]
    if missing:
        raise ValueError(f"{source}: tensors {missing} are not in its safetensors files")
    groups: dict[str, list[str]] = defaultdict(list)
    for n in names:
        groups[wm[n]].append(n)
    out = {}
    for shard in sorted(groups):
        path = resolve_file(source, shard, revision)
        if path is None:
            raise ValueError(f"{source}: its {INDEX} names {shard}, which is missing; re-download or re-export")
        out[path] = groups[shard]
    return out


def tensor_headers(source: str | Path, revision: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype such as "BF16")} without reading any tensor data."""
    from safetensors import safe_open

    out = {}
    for path, names in _by_shard(source, revision, None).items():
        with safe_open(str(path), framework="pt") as f:
            for n in names:
                sl = f.get_slice(n)
                out[n] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def read_tensors(source: str | Path, names: Iterable[str] | None = None,
                 revision: str | None = None) -> dict[str, torch.Tensor]:
    """The named tensors (all when ``names`` is None), opening only the shards that hold them."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path, group in _by_shard(source, revision, names).items():
        with safe_open(str(path), framework="pt") as f:
            for n in group:
                out[n] = f.get_tensor(n)
    return out


EMBEDDING = "embed_tokens.weight"
# The module path in front of a numbered decoder layer: "model." in model.layers.3.mlp..., "" in layers.3....
_STACK = re.compile(r"^((?:[^.]+\.)*?)layers\.\d+\.")


def _is_named(name: str, leaf: str) -> bool:
    return name == leaf or name.endswith("." + leaf)


def decoder_prefix(names: Iterable[str]) -> str:
    """The module path of the target's text decoder among its tensor names: ``model.`` (Llama, DeepSeek-V3),
    ``language_model.model.`` (Kimi-K2.5/K2.6), ``model.language_model.`` (Qwen3-VL).

    It is the module that holds the input embedding (``<prefix>embed_tokens.weight``) beside numbered
    decoder layers (``<prefix>layers.N.``): a vision tower's layers have no embedding beside them, and an
    MTP module's embedding sits inside a layer (DeepSeek-V3's ``model.layers.61.embed_tokens.weight``).
    Raises ValueError when no module, or more than one, qualifies."""
    names = list(names)
    stacks = {m.group(1) for n in names if (m := _STACK.match(n))}
    embeddings = {n[:-len(EMBEDDING)] for n in names if _is_named(n, EMBEDDING) and not _IN_LAYER.search(n)}
    found = (embeddings & stacks) or embeddings  # a checkpoint of a few tensors may hold no layers at all
    if not found:
        raise ValueError("no tensor named *embed_tokens.weight (outside the decoder layers) among the target's "
                         "weights; Fledge needs the target's input embedding")
    if len(found) > 1:
        raise ValueError(f"the target's weights hold two or more decoder stacks with an input embedding "
                         f"({', '.join(sorted(found))}): Fledge cannot tell which one is the target's text decoder")
    return found.pop()


def final_norm_name(names: Iterable[str]) -> str | None:
    """The final norm of the target's text decoder: ``<decoder_prefix>norm.weight`` (or the one other
    ``*norm.weight`` directly under that module), None when it has none. A vision projector's or an MTP
    module's norm is never taken, however short its name."""
    names = list(names)
    prefix = decoder_prefix(names)
    own = [n for n in names if n.startswith(prefix) and n.count(".") == prefix.count(".") + 1
           and n.endswith("norm.weight")]
    if prefix + "norm.weight" in own:
        return prefix + "norm.weight"
    return own[0] if len(own) == 1 else None


def input_embedding_name(names: Iterable[str]) -> str:
    """The target's input embedding among its tensor names (``model.embed_tokens.weight`` and the like)."""
    return decoder_prefix(names) + EMBEDDING


def lm_head_name(names: Iterable[str]) -> str | None:
    """The target's output head: the ``lm_head.weight`` outside the decoder layers whose module encloses the
    text decoder (``lm_head.weight`` beside ``model.``, ``language_model.lm_head.weight`` beside
    ``language_model.model.``), the innermost when several do; None when it is not stored (tied)."""
    names = list(names)
    prefix = decoder_prefix(names)
    parents = [n[:-len("lm_head.weight")] for n in names if _is_named(n, "lm_head.weight") and not _IN_LAYER.search(n)]
    parents = [p for p in parents if prefix.startswith(p)]
    return max(parents, key=len) + "lm_head.weight" if parents else None


def load_input_embeddings(source: str | Path, revision: str | None = None) -> torch.Tensor:
    """The target's input embedding ``[V, H]``, read from its safetensors files."""
    name = input_embedding_name(weight_map(source, revision))
    return read_tensors(source, [name], revision)[name]


def _tied(source, revision) -> bool:
    """Whether the target ties lm_head to its input embedding (its config.json, the text part of a
    multimodal config when the outer config does not say)."""
    cfg_file = resolve_file(source, "config.json", revision)
    cfg = json.loads(cfg_file.read_text()) if cfg_file else {}
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    return bool(text_config_dict(cfg).get("tie_word_embeddings", False)) if cfg else False


# Bytes of one block of rows read at a time by read_rows: what taking Vd rows of a [V, H] matrix costs on
# top of the Vd rows themselves, whatever V is (a 163840 x 7168 bf16 lm_head is 2.35 GB; a block 64 MiB).
ROW_BLOCK_BYTES = 64 << 20


def read_rows(source: str | Path, name: str, ids: torch.Tensor, revision: str | None = None) -> torch.Tensor:
    """Rows ``ids`` of the 2-D tensor ``name`` (a copy, in ``ids`` order), read in blocks of about
    ROW_BLOCK_BYTES: memory is the rows kept plus one block, never the whole tensor. Each block reopens the
    shard, so the memory map of the block read before is released (its pages would otherwise stay resident)."""
    from safetensors import safe_open

    (path, _), = _by_shard(source, revision, [name]).items()
    ids = ids.to(torch.long).flatten()
    with safe_open(str(path), framework="pt") as f:
        V, H = f.get_slice(name).get_shape()
        first = f.get_slice(name)[0:1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{name}: row ids outside [0, {V})")
    out = torch.empty((ids.numel(), H), dtype=first.dtype)
    block = max(1, ROW_BLOCK_BYTES // max(1, H * first.element_size()))
    order = torch.argsort(ids)
    sorted_ids = ids[order]
    bounds = torch.searchsorted(sorted_ids, torch.arange(0, V + block, block))
    for b in range((V + block - 1) // block):  # row blocks [b * block, (b + 1) * block)
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        if lo == hi:
            continue  # no wanted row in this block: never read
        want = sorted_ids[lo:hi]
        first_row, last_row = int(want[0]), int(want[-1]) + 1
        with safe_open(str(path), framework="pt") as f:
            rows = f.get_slice(name)[first_row:last_row]
        out[order[lo:hi]] = rows[want - first_row]
        del rows
    return out


def load_lm_head_rows(source: str | Path, revision: str | None, selected_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``selected_ids`` of the target's lm_head ``[Vd, Ht]`` (a copy). With tied embeddings (config
    ``tie_word_embeddings``, or no lm_head stored) they are the input embedding's rows. Read in row blocks
    (read_rows): the memory is Vd rows plus one block, not the [V, Ht] head (2.35 GB for Kimi-K2's)."""
    names = weight_map(source, revision)
    head = lm_head_name(names)
    name = head if head is not None and not _tied(source, revision) else input_embedding_name(names)
    return read_rows(source, name, selected_ids, revision)
