"""The frozen target: a transformers causal LM plus forward hooks that capture what a drafter learns from.

Boundary convention (docs/architecture.md, Aux layer ids): id ``k`` is the residual stream *entering* decoder layer
``k``, i.e. ``hidden_states[k]`` of an HF forward with ``output_hidden_states=True`` (0 = embeddings). A forward
pre-hook on ``layers[k]`` sees exactly that tensor, so only the requested states are kept alive, never all
L+1 of them. The teacher's state is the base model's output (after the final norm: what feeds lm_head),
which is also id ``L`` here, as ``hidden_states[L]`` is in transformers (what an MTP module reads:
models/mtp_drafter.py). The full-vocab argmax is computed from lm_head in row chunks so a long row's [T, V]
logits never exist at once.

The target's config is read through its family (models/families.py); single tensors (the embedding, the
teacher's draft-vocab lm_head rows) are read without instantiating the target by models/weights.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from fledge.conf.schema import TargetConfig
from fledge.models.families import read_target
from fledge.models.precision import cast_for_compute

LOGITS_CHUNK_BYTES = 1 << 28  # ~256 MiB of logits per lm_head chunk


def _torch_dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def check_target_config(hf_config, tcfg: TargetConfig) -> None:
    """Raise ValueError when the real config disagrees with what the recipe wrote in ``target.*`` (or when
    the target's family is not registered: the drafter could not be shaped for it)."""
    shape = read_target(hf_config)[1]
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        want, got = getattr(tcfg, key), getattr(shape, key)
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
        if any(not 0 <= k <= L for k in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids={self.aux_layer_ids}: boundary ids must lie in [0, {L}] ({L}: the final "
                             "normed state)")
        self.lm_head = model.get_output_embeddings()
        self.hidden_size = self.lm_head.weight.shape[1]
        self.vocab_size = self.lm_head.weight.shape[0]
        self._store: dict[int, torch.Tensor] = {}
        for k in sorted(set(self.aux_layer_ids) - {L}):
            self.layers[k].register_forward_pre_hook(self._make_hook(k), with_kwargs=True)

    @classmethod
    def load(cls, tcfg: TargetConfig, device: torch.device, aux_layer_ids: list[int],
             device_map: str | None = None) -> FrozenTarget:
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
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (aux [B, T, n*Ht] in aux-id order, final_normed [B, T, Ht], argmax [B, T] int64).

        Positions where ``attention_mask`` is 0 get argmax 0 (their states are whatever the model makes).
        With ``0 < chunk_tokens < T`` the rows are read in pieces of ``chunk_tokens`` through the target's own
        KV cache (capture.chunk_tokens): the same states as one forward (to the kernels' rounding), with
        attention scores of [chunk, T] per layer instead of [T, T] and no [T, T] mask."""
        T = input_ids.shape[1]
        self._store.clear()
        try:
            if not chunk_tokens or T <= chunk_tokens:
                aux, final = self._forward(input_ids, attention_mask, position_ids)
            else:
                aux, final = self._forward_chunked(input_ids, attention_mask, position_ids, chunk_tokens)
        finally:
            self._store.clear()
        return aux, final, self.argmax(final, attention_mask)

    def _forward(self, input_ids, attention_mask, position_ids, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=cache is not None)
        final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        L = len(self.layers)
        aux = torch.cat([final if k == L else self._store[k].to(final.device) for k in self.aux_layer_ids], dim=-1)
        return aux, final

    def _forward_chunked(self, input_ids, attention_mask, position_ids, chunk: int):
        """One forward per ``chunk`` columns, each reading the earlier ones from a DynamicCache. The mask
        given for chunk [s, e) is columns [0, e) (past + current), as transformers expects with a cache."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        auxes, finals = [], []
        for s in range(0, input_ids.shape[1], chunk):
            e = s + chunk
            mask = None if attention_mask is None else attention_mask[:, :e]
            pos = None if position_ids is None else position_ids[:, s:e]
            aux, final = self._forward(input_ids[:, s:e], mask, pos, cache)
            auxes.append(aux)
            finals.append(final)
        return torch.cat(auxes, 1), torch.cat(finals, 1)

    def argmax(self, final: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
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

    def input_embeddings(self) -> torch.Tensor:
        """The target's input embedding matrix [V, H] (detached; shared storage, do not modify)."""
        return self.model.get_input_embeddings().weight.detach()
