"""The frozen target: a transformers causal LM plus forward hooks that capture what a drafter learns from.

Boundary convention (SPEC.md section 2): id ``k`` is the residual stream *entering* decoder layer ``k``,
i.e. ``hidden_states[k]`` of an HF forward with ``output_hidden_states=True`` (0 = embeddings). A forward
pre-hook on ``layers[k]`` sees exactly that tensor, so only the requested states are kept alive, never all
L+1 of them. The teacher's state is the base model's output (after the final norm: what feeds lm_head),
and the full-vocab argmax is computed from lm_head in row chunks so a long row's [T, V] logits never exist
at once.

The lm_head / embedding helpers read single tensors from the safetensors files (via the index), so the
trainer gets the teacher's draft-vocab rows without instantiating the target.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from fledge.conf.schema import TargetConfig
from fledge.models.precision import cast_for_compute

LOGITS_CHUNK_BYTES = 1 << 28  # ~256 MiB of logits per lm_head chunk
_EMBED_SUFFIX = "embed_tokens.weight"


def _torch_dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def check_target_config(hf_config, tcfg: TargetConfig) -> None:
    """Raise ValueError when the real config disagrees with what the recipe wrote in ``target.*``."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        want, got = getattr(tcfg, key), getattr(text, key, None)
        if want and got != want:
            raise ValueError(
                f"target.{key}={want} but {tcfg.name_or_path} has {key}={got}; "
                f"fix target.{key} in the recipe (conf/target/*.yaml)"
            )


def target_fingerprint(name_or_path: str) -> str:
    """For a local target: its config plus the size and mtime of its weight files (cheap, no reads
    of the weights); for a hub id, the id itself (the revision is in the config slice)."""
    p = Path(name_or_path)
    if not p.is_dir():
        return name_or_path
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.suffix in (".json", ".safetensors", ".bin", ".model", ".jinja"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


class FrozenTarget:
    """A frozen causal LM (eval, no grad) that returns aux states, final normed state and argmax."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        self.aux_layer_ids = list(aux_layer_ids)
        self.decoder = model.get_decoder()
        self.layers = self._find_layers(self.decoder)
        L = len(self.layers)
        if any(not 0 <= k < L for k in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids={self.aux_layer_ids}: boundary ids must lie in [0, {L - 1}]")
        self.lm_head = model.get_output_embeddings()
        self.hidden_size = self.lm_head.weight.shape[1]
        self.vocab_size = self.lm_head.weight.shape[0]
        self._store: dict[int, torch.Tensor] = {}
        for k in sorted(set(self.aux_layer_ids)):
            self.layers[k].register_forward_pre_hook(self._make_hook(k), with_kwargs=True)

    @classmethod
    def load(cls, tcfg: TargetConfig, device: torch.device, aux_layer_ids: list[int],
             device_map: Optional[str] = None) -> "FrozenTarget":
        """from_pretrained(tcfg.name_or_path, revision, dtype) on ``device`` (or spread by ``device_map``),
        after checking the real config against ``target.{num_hidden_layers,hidden_size,vocab_size}``.

        On a CPU without native bf16, a bf16 target (``target.dtype=bfloat16``, or ``auto`` with bf16
        weights) is computed in fp32 (models/precision.py); capture still stores what it always stored."""
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = dict(revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
        check_target_config(AutoConfig.from_pretrained(tcfg.name_or_path, **kw), tcfg)
        model = AutoModelForCausalLM.from_pretrained(
            tcfg.name_or_path, dtype=_torch_dtype(tcfg.dtype), device_map=device_map, **kw)
        if device_map is None:
            model.to(device)
            # "auto" is only known to mean bf16 once loaded, so the rule is applied to the loaded model
            cast_for_compute(model, device, f"target.dtype={tcfg.dtype}")
        return cls(model, aux_layer_ids)

    @staticmethod
    def _find_layers(decoder: nn.Module) -> nn.ModuleList:
        layers = getattr(decoder, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
        n = decoder.config.get_text_config().num_hidden_layers
        for mod in decoder.modules():  # other naming (e.g. `h`, `blocks`): the ModuleList of L layers
            if isinstance(mod, nn.ModuleList) and len(mod) == n:
                return mod
        raise ValueError(f"cannot find the {n} decoder layers of {type(decoder).__name__}")

    def _make_hook(self, k: int):
        def hook(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self._store[k] = h.detach()
        return hook

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (aux [B, T, n*Ht] in aux-id order, final_normed [B, T, Ht], argmax [B, T] int64).

        Positions where ``attention_mask`` is 0 get argmax 0 (their states are whatever the model makes)."""
        self._store.clear()
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
            final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            aux = torch.cat([self._store[k].to(final.device) for k in self.aux_layer_ids], dim=-1)
        finally:
            self._store.clear()
        return aux, final, self.argmax(final, attention_mask)

    def argmax(self, final: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-vocab argmax of lm_head(final) [B, T] int64, computed in row chunks of ~256 MiB of logits."""
        B, T, _ = final.shape
        flat = final.reshape(B * T, -1)
        keep = None if attention_mask is None else attention_mask.reshape(-1).bool().to(final.device)
        rows = flat if keep is None else flat[keep]
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * self.vocab_size))
        w = self.lm_head.weight
        parts = [self.lm_head(rows[i:i + chunk].to(w.device)).argmax(-1) for i in range(0, rows.shape[0], chunk)]
        got = torch.cat(parts).to(final.device) if parts else rows.new_zeros(0, dtype=torch.long)
        if keep is None:
            return got.view(B, T)
        out = torch.zeros(B * T, dtype=torch.long, device=final.device)
        out[keep] = got
        return out.view(B, T)

    def lm_head_rows(self, selected_ids: torch.Tensor) -> torch.Tensor:
        """The draft-vocab rows of the target's lm_head: [Vd, Ht] (a copy, detached)."""
        w = self.lm_head.weight
        return w.detach()[selected_ids.to(w.device)].clone()

    def input_embeddings(self) -> torch.Tensor:
        """The target's input embedding matrix [V, H] (detached; shared storage, do not modify)."""
        return self.model.get_input_embeddings().weight.detach()


# ---- reading single tensors without instantiating the model ------------------------------------------

def _resolve_file(name_or_path: str, revision: Optional[str], filename: str) -> Optional[Path]:
    p = Path(name_or_path)
    if p.is_dir():
        f = p / filename
        return f if f.exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(name_or_path, filename, revision=revision))
    except EntryNotFoundError:
        return None


def load_target_tensors(name_or_path: str, revision: Optional[str], names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors from the target's safetensors files (single file or sharded with an index),
    opening only the shards that hold them."""
    from safetensors import safe_open

    index = _resolve_file(name_or_path, revision, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = _resolve_file(name_or_path, revision, "model.safetensors")
        if single is None:
            raise ValueError(f"{name_or_path}: no model.safetensors(.index.json); only safetensors targets "
                             "support reading single tensors")
        with safe_open(str(single), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise KeyError(f"{name_or_path}: tensors {missing} not in its safetensors files")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted({weight_map[n] for n in names}):
        path = _resolve_file(name_or_path, revision, shard)
        with safe_open(str(path), framework="pt") as f:
            for n in names:
                if weight_map[n] == shard:
                    out[n] = f.get_tensor(n)
    return out


def _tensor_names(name_or_path: str, revision: Optional[str]) -> list[str]:
    from safetensors import safe_open

    index = _resolve_file(name_or_path, revision, "model.safetensors.index.json")
    if index is not None:
        return list(json.loads(index.read_text())["weight_map"])
    single = _resolve_file(name_or_path, revision, "model.safetensors")
    if single is None:
        raise ValueError(f"{name_or_path}: no safetensors weights found")
    with safe_open(str(single), framework="pt") as f:
        return list(f.keys())


def _embedding_name(names: list[str]) -> str:
    cands = sorted((n for n in names if n.endswith(_EMBED_SUFFIX)), key=len)
    if not cands:
        raise KeyError(f"no tensor named *{_EMBED_SUFFIX} among the target's weights")
    return cands[0]


def load_input_embeddings(name_or_path: str, revision: Optional[str] = None) -> torch.Tensor:
    """The target's input embedding [V, H], read from its safetensors files."""
    name = _embedding_name(_tensor_names(name_or_path, revision))
    return load_target_tensors(name_or_path, revision, [name])[name]


def load_lm_head_rows(name_or_path: str, revision: Optional[str], selected_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``selected_ids`` of the target's lm_head [Vd, Ht], read from its safetensors files. With tied
    embeddings (config ``tie_word_embeddings``, or no ``lm_head.weight`` stored) they are the embedding's."""
    names = _tensor_names(name_or_path, revision)
    cfg_file = _resolve_file(name_or_path, revision, "config.json")
    cfg = json.loads(cfg_file.read_text()) if cfg_file else {}
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False))
    name = "lm_head.weight" if ("lm_head.weight" in names and not tied) else _embedding_name(names)
    w = load_target_tensors(name_or_path, revision, [name])[name]
    return w[selected_ids.to(torch.long)].clone()
