"""DFlash's serving layout: the directory vLLM 0.32's ``DFlashQwen3ForCausalLM`` loads (``method="dflash"``), and
everything serving does with it (the functions of serving/layouts.py's ``Layout``, registered there as ``dflash``):
its config.json and tensors, the spec read back, the lint, the module loaded for the harness, vLLM's speculative
config and the card.

What vLLM reads (vllm/model_executor/models/qwen3_dflash.py, config/speculative.py, the aux-layer reader
v1/worker/gpu/spec_decode/eagle/eagle3_utils.py), and so what the export writes and the linter checks:

- ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"``: the layers are Qwen3's (q/k norms; an explicit
  ``head_dim``), ``num_hidden_layers`` of them, built from the top-level keys, RoPE included (written in both
  spellings, as every export: serving/serving_config.py).
- ``dflash_config.target_layer_ids``: the *0-based index of the layer whose output* feeds ``fc`` (vLLM adds 1 to get
  its capture boundary). Fledge's aux ids are boundary ids (docs/architecture.md), so ``target_layer_ids = b - 1``;
  writing the boundary ids shifts every state one layer deeper, the AL ~1 of the peers' DFlash issues. Any
  ``eagle_aux_hidden_state_layer_ids`` in the config wins over them in vLLM, so the export writes none.
- ``dflash_config.mask_token_id``: the id every slot after the bonus token is fed (embedded by the *target's* table,
  shared with the drafter); it must be the one training filled the blocks with.
- attention inside a block is bidirectional: vLLM makes a layer causal when ``is_causal``, ``dflash_config.causal``
  or a ``sliding_attention`` entry of ``layer_types`` says so; the export writes ``use_sliding_window: false`` and
  every layer ``full_attention``.
- ``block_size`` (top level and in ``dflash_config``, as the peers' checkpoints carry it) is the block training
  used: vLLM drafts ``num_speculative_tokens`` slots whatever it says, and offsets past ``block_size - 1`` were
  never trained.
- tensors: ``fc.weight [H, n*Ht]``, ``hidden_norm``, ``layers.{i}.*`` (Qwen3), ``norm``; no ``embed_tokens`` (vLLM
  shares the target's when absent: the drafter was trained on it, frozen), no ``mask_hidden`` (vLLM asserts).
- a draft vocab smaller than the target's: ``draft_vocab_size`` at the top level, the target's ``lm_head.weight`` rows
  ``[Vd, H]`` the drafter scored with (vLLM keeps an ``lm_head`` it loads as the drafter's own) and ``d2t [Vd]`` (int64
  offsets, target id = i + d2t[i]: vLLM scatters the draft logits onto the target vocab with it; ``t2d`` rides along
  for fine-tuning, vLLM skips it). Over the whole vocab none of the three is written (vLLM shares the target's head).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fledge.models.algorithms import DrafterSpec, build_drafter
from fledge.models.dflash import aux_layer_ids_of, serving_layer_ids
from fledge.models.drafter_checkpoint import RECORD
from fledge.models.drafter_module import t2d_of
from fledge.models.weights import load_input_embeddings, load_lm_head_rows, read_tensors
from fledge.serving.export_reading import Finding, read_export, vocab_findings

ARCHITECTURE = "DFlashDraftModel"
_FROZEN = ("embed_tokens.weight", "lm_head.weight")  # the target's: vLLM shares them


def owns(config: Mapping) -> bool:
    """Whether an exported config.json is a DFlash drafter's (the architecture vLLM maps to its DFlash model)."""
    archs = config.get("architectures") or []
    return any(a.startswith("DFlash") for a in archs) or "dflash_config" in config


def build_config(layer: dict, spec: Any, aux_layer_ids: list[int], target_hidden_size: int,
                 target_num_layers: int) -> dict:
    """config.json of a DFlash drafter: ``layer`` the Qwen3 layer settings of the target (serving_config's), the
    drafter's ``num_draft_layers``, ``block_size`` and ``mask_token_id`` from ``spec`` (a DrafterSpec or config)."""
    n, block = int(spec.num_draft_layers), int(spec.block_size)
    cfg = {"architectures": [ARCHITECTURE], **layer, "model_type": "qwen3", "num_hidden_layers": n,
           "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * n,
           "block_size": block, "num_target_layers": int(target_num_layers),
           "dflash_config": {"mask_token_id": int(spec.mask_token_id),
                             "target_layer_ids": serving_layer_ids(aux_layer_ids), "block_size": block}}
    cfg.pop("mlp_bias", None)
    if int(spec.draft_vocab_size) != int(layer["vocab_size"]):
        cfg["draft_vocab_size"] = int(spec.draft_vocab_size)
    if int(layer["hidden_size"]) != int(target_hidden_size):
        cfg["target_hidden_size"] = int(target_hidden_size)
    return cfg


def serving_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's state_dict -> the tensors the export writes: floats in bf16, the vocab maps as they are; the
    target's embedding left out, and its lm_head too unless a draft vocab's rows (the maps are in the state_dict then:
    models/dflash.py)."""
    whole = "d2t" not in state_dict
    return {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).detach().cpu().contiguous()
            for name, t in state_dict.items() if name != "embed_tokens.weight" and not (whole and name in _FROZEN)}


def spec_from_config(config: Mapping, target_num_hidden_layers: int | None = None) -> DrafterSpec:
    """The DrafterSpec a DFlash config.json describes, read as vLLM builds it (a public DFlash checkpoint too)."""
    dflash = dict(config.get("dflash_config") or {})
    ids = dflash.get("target_layer_ids")
    if not ids:
        raise ValueError("config.json has no dflash_config.target_layer_ids: add the 0-based target layers whose "
                         "outputs the drafter was trained on")
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise ValueError("config.json has no dflash_config.mask_token_id: add the id training filled the blocks with")
    Ht = int(config.get("target_hidden_size") or config["hidden_size"])
    hf = {**config, "model_type": "qwen3", "hidden_size": Ht}
    aux = aux_layer_ids_of(ids)
    hf["num_hidden_layers"] = int(target_num_hidden_layers or config.get("num_target_layers") or max(aux) + 1)
    block = int(dflash.get("block_size") or config.get("block_size") or 16)
    flags = SimpleNamespace(algorithm="dflash", fc_norm=False, norm_output=False, norm_before_fc=False,
                            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
                            mask_token_id=int(mask), block_size=block,
                            num_draft_layers=int(config.get("num_hidden_layers") or 1), layer="qwen3")
    spec = DrafterSpec.from_target_config(hf, flags, aux)
    if int(config["hidden_size"]) != Ht:
        spec = dataclasses.replace(spec, hidden_size=int(config["hidden_size"]),
                                   intermediate_size=int(config["intermediate_size"]))
    return spec


def expected_tensors(config: Mapping) -> dict[str, tuple[int, ...]]:
    """{name: shape} a DFlash config.json implies (all bf16)."""
    H, I, V = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["vocab_size"])
    Vd = int(config.get("draft_vocab_size") or V)
    Ht = int(config.get("target_hidden_size") or H)
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    D = int(config.get("head_dim") or H // heads)
    n_aux = len((config.get("dflash_config") or {}).get("target_layer_ids") or [])
    out = {"fc.weight": (H, n_aux * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(int(config.get("num_hidden_layers") or 1)):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (heads * D, H), p + "self_attn.k_proj.weight": (kv * D, H),
                    p + "self_attn.v_proj.weight": (kv * D, H), p + "self_attn.o_proj.weight": (H, heads * D),
                    p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
    out["optional:embed_tokens.weight"] = (V, H)
    if Vd == V:
        out["optional:lm_head.weight"] = (V, H)
    else:  # a draft vocab: its head rows and map are the drafter's (vLLM refuses a reduced DSpark without them)
        out.update({"lm_head.weight": (Vd, H), "d2t": (Vd,), "optional:t2d": (V,)})
    return out


def lint(d, config: Mapping, target_layers: int | None, record: dict | None) -> list[Finding]:
    """The DFlash-specific findings on the export in ``d`` (serving/lint.py adds the checks against the target and
    the training record that every layout gets): its header, layer ids, mask token, block and tensors, and the
    CPU build's k_norm sharing."""
    headers, trained, out = read_export(d, record)
    out += findings(config, headers, target_layers, trained)
    out += vocab_findings(d, config, headers)
    n = int(config.get("num_hidden_layers") or 0)
    names = [f"layers.{i}.self_attn.k_norm.weight" for i in range(n)]
    if n > 1 and headers is not None and all(name in headers for name in names):
        k_norms = read_tensors(d, names)
        if any(not torch.equal(k_norms[names[0]], k_norms[name]) for name in names[1:]):
            out.append(("warning", "dflash-cpu-k-norm", f"{n} layers with different k_norm weights: vLLM 0.32's CPU "
                        "build normalises every layer's context keys with layer 0's k_norm (its GPU kernel takes each "
                        "layer's), so on a CPU this drafter is served with other keys than trained", "serve it on a "
                        "GPU, or train drafter.num_draft_layers=1 for CPU serving"))
    return out + no_record(record)


def no_record(record: dict | None) -> list[Finding]:
    return [] if record is not None else [(
        "warning", "no-training-record", f"no {RECORD}: the mask token, block size and layer ids cannot be checked "
        "against training", "export with Fledge, or confirm how the checkpoint was trained")]


@dataclass(frozen=True)
class Reading:
    """What vLLM reads from a block drafter's config.json, each with the key it came from: the id the masks are fed,
    the 0-based target layers (None: none written) and the block."""

    mask_token_id: Any
    mask_key: str
    layer_ids: Any
    layers_key: str
    block_size: Any
    block_key: str


def reading(config: Mapping) -> Reading:
    """DFlash's: ``dflash_config`` (the top level's ``mask_token_id`` and ``block_size`` under it)."""
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    return Reading(dflash.get("mask_token_id", config.get("mask_token_id")), "dflash_config.mask_token_id",
                   dflash.get("target_layer_ids"), "dflash_config.target_layer_ids",
                   dflash.get("block_size", config.get("block_size")), "block_size")


def findings(config: Mapping, headers: Mapping[str, tuple[list[int], str]] | None, target_layers: int | None,
             trained: DrafterSpec | None) -> list[Finding]:
    """What would make vLLM serve this DFlash export otherwise than it was trained (``trained``: the training
    record's spec), or refuse it; ``headers``: {tensor: (shape, dtype)} of its safetensors."""
    out: list[Finding] = []
    archs = config.get("architectures") or []
    if ARCHITECTURE not in archs and not any(a.startswith("DFlash") for a in archs):
        out.append(("error", "architecture", f"architectures={archs}: vLLM builds its DFlash drafter from an "
                    "architecture starting with DFlash", f'set "architectures": ["{ARCHITECTURE}"]'))
    if not isinstance(config.get("dflash_config"), Mapping):
        out.append(("error", "dflash-config", "no dflash_config: vLLM reads mask_token_id and target_layer_ids from "
                    "it", "re-export the drafter with Fledge (drafter.algorithm=dflash)"))
    out += block_findings(config, reading(config), target_layers, trained, "DFlash")
    if headers is not None:
        out += tensor_findings(expected_tensors, config, headers)
    return out


def block_findings(config: Mapping, read: Reading, target_layers: int | None, trained: DrafterSpec | None,
                   name: str, anchor_drafts: bool = False) -> list[Finding]:
    """The findings every block drafter built on DFlash shares (``name``: DFlash or DSpark, whose lowercase prefixes
    the codes; ``anchor_drafts``: a block of B drafts B tokens, else B - 1): a Qwen3 header, the mask token, the layer
    ids, the block, bidirectional attention, and the layer settings training fixed, read as ``read`` says vLLM reads
    them."""
    out: list[Finding] = []
    add = lambda *f: out.append(f)  # noqa: E731
    code = name.lower()
    if config.get("model_type") != "qwen3":
        add("error", "model-type", f"model_type={config.get('model_type')!r}: vLLM's {name} drafter is built from a "
            "Qwen3 config", 'set "model_type": "qwen3"')
    if not config.get("head_dim"):
        add("error", "head-dim", "no head_dim: the q/k norms' width would be read as hidden_size / heads",
            "set head_dim from the training record's spec")
    eagle_ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if eagle_ids:
        add("error", f"{code}-eagle-ids", f"eagle_aux_hidden_state_layer_ids={list(eagle_ids)} is set: vLLM takes it "
            f"over {read.layers_key}, as boundary ids", f"remove it; {read.layers_key} names the layers")
    out += _mask_findings(read, int(config.get("vocab_size") or 0), trained, code)
    out += _layer_findings(read, target_layers, trained, code)
    drafts = "exactly B" if anchor_drafts else "at most B - 1"
    if read.block_size is None:
        add("warning", f"{code}-block-size", f"no block_size: the block training used cannot be checked, and serving "
            f"a block of another length runs one it was not trained on ({name} drafts {drafts} tokens of a block of "
            "B)", "write the training block_size")
    elif trained is not None and int(read.block_size) != trained.block_size:
        served = trained.block_size - 1 + int(anchor_drafts)
        add("error", f"{code}-block-size", f"{read.block_key}={read.block_size} but the drafter was trained on blocks "
            f"of {trained.block_size}", f"write block_size={trained.block_size} and serve "
            f"{'exactly' if anchor_drafts else 'at most'} {served} speculative tokens")
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    causal = [why for why, on in (("is_causal", config.get("is_causal")),
                                  ("dflash_config.causal", dflash.get("causal")),
                                  ("use_sliding_window", config.get("use_sliding_window")),
                                  ("layer_types", "sliding_attention" in (config.get("layer_types") or []))) if on]
    if causal:
        add("error", f"{code}-causal", f"{', '.join(causal)} make vLLM run causal or windowed attention inside the "
            "block, which the drafter was trained without", 'remove them; write "use_sliding_window": false and '
            'every layer "full_attention"')
    n = int(config.get("num_hidden_layers") or 0)
    if trained is not None and n != trained.num_draft_layers:
        add("error", "num-layers", f"num_hidden_layers={n} but the drafter was trained with {trained.num_draft_layers} "
            "layers", f'set "num_hidden_layers": {trained.num_draft_layers}')
    if trained is not None and config.get("rms_norm_eps") is not None and not math.isclose(
            float(config["rms_norm_eps"]), trained.rms_norm_eps, rel_tol=1e-6):
        add("error", "rms-eps-trained", f"rms_norm_eps={config['rms_norm_eps']} but training used "
            f"{trained.rms_norm_eps}", f"set rms_norm_eps={trained.rms_norm_eps}")
    if trained is not None and config.get("max_position_embeddings") != trained.max_position_embeddings:
        add("error", "max-positions-trained", f"max_position_embeddings={config.get('max_position_embeddings')} but "
            f"the drafter was trained with {trained.max_position_embeddings} (the target's): vLLM sizes the block's "
            "RoPE cache from it", f"set max_position_embeddings={trained.max_position_embeddings}")
    return out


def _mask_findings(read: Reading, V: int, trained: DrafterSpec | None, code: str) -> list[Finding]:
    mask = read.mask_token_id
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < V:
        return [("error", f"{code}-mask-token", f"{read.mask_key}={mask!r}: the slots after the bonus token are fed "
                 f"this id, which must be a token of the vocab [0, {V})", "write the id the drafter was trained with "
                 "(its training record's spec.mask_token_id)")]
    if trained is not None and trained.mask_token_id is not None and mask != trained.mask_token_id:
        return [("error", f"{code}-mask-token", f"{read.mask_key}={mask} but the drafter was trained with "
                 f"{trained.mask_token_id}: every slot would see an embedding it never saw",
                 f"set it to {trained.mask_token_id}")]
    return []


def _layer_findings(read: Reading, target_layers: int | None, trained: DrafterSpec | None,
                    code: str) -> list[Finding]:
    out: list[Finding] = []
    add = lambda *f: out.append(f)  # noqa: E731
    key = read.layers_key
    if not read.layer_ids:
        add("error", f"{code}-layer-ids", f"no {key}: vLLM would not know which target layers to capture",
            "write the 0-based layers (boundary aux ids - 1)")
        return out
    ids = [int(i) for i in read.layer_ids]
    if ids != sorted(set(ids)):
        add("error", f"{code}-layer-ids", f"target_layer_ids={ids} are not ascending: vLLM concatenates the states in "
            "layer order", "write them ascending, in the order training concatenated them")
    if target_layers is not None and (min(ids) < 0 or max(ids) > target_layers - 1):
        add("error", f"{code}-layer-ids", f"target_layer_ids={ids} fall outside the target's layers 0.."
            f"{target_layers - 1}", "write 0-based layer indices (boundary aux ids - 1)")
    if trained is not None:
        want = serving_layer_ids(trained.aux_layer_ids)
        if ids == list(trained.aux_layer_ids):
            add("error", f"{code}-layer-ids", f"target_layer_ids={ids} are the boundary ids the drafter was trained "
                "on, written as they are: vLLM adds 1 and would capture one layer deeper than training",
                f"write {want} (0-based: the output of layer b - 1)")
        elif ids != want:
            add("error", f"{code}-layer-ids", f"target_layer_ids={ids} but the drafter was trained on the outputs of "
                f"layers {want}", f"write {want}")
    return out


def tensor_findings(expected_of, config: Mapping, headers: Mapping[str, tuple[list[int], str]]) -> list[Finding]:
    """The export's tensors against those ``expected_of(config)`` implies ({name: shape}, ``optional:`` names may be
    absent; all bf16)."""
    try:
        expected = expected_of(config)
    except (KeyError, TypeError, ValueError) as e:
        return [("error", "shape", f"cannot compute the tensors config.json implies: missing {e}", "re-export")]
    out: list[Finding] = []
    for name, (shape, dtype) in headers.items():
        if name == "mask_hidden":
            out.append(("error", "unexpected-tensor", "mask_hidden is present: vLLM's DFlash loader asserts on it "
                        "(slots are the mask token's embedding)", "remove it (it is P-EAGLE's, not DFlash's)"))
        elif name in ("d2t", "t2d") and f"optional:{name}" not in expected and name not in expected:
            continue  # vLLM drops t2d, and d2t over the whole vocab
        elif name in ("d2t", "t2d"):
            want = expected.get(name) or expected[f"optional:{name}"]
            if tuple(shape) != tuple(want):
                out.append(("error", "shape", f"{name} has shape {list(shape)}, the config implies {list(want)}",
                            "re-export the drafter (its draft vocab and draft_vocab_size disagree)"))
            elif dtype != {"d2t": "I64", "t2d": "BOOL"}[name]:
                out.append(("error", "dtype", f"{name} is {dtype}: the vocab maps are d2t int64 offsets (vLLM adds "
                            "them to draft ids) and t2d bool", "re-export the drafter (d2t int64, t2d bool)"))
        elif name not in expected and f"optional:{name}" not in expected:
            out.append(("error", "unexpected-tensor", f"unexpected tensor {name} {list(shape)}",
                        "remove it: vLLM's loader fails on names it does not know"))
        elif tuple(shape) != tuple(expected.get(name) or expected[f"optional:{name}"]):
            want = expected.get(name) or expected[f"optional:{name}"]
            out.append(("error", "shape", f"{name} has shape {list(shape)}, the config implies {list(want)}",
                        "fix config.json (sizes copied from the target) or re-export the weights"))
        elif dtype != "BF16":
            out.append(("warning", "dtype", f"{name} is {dtype}, expected BF16", f"cast {name} to bfloat16"))
    for name, shape in expected.items():
        if not name.startswith("optional:") and name not in headers:
            out.append(("error", "missing-tensor", f"missing tensor {name} {list(shape)}", "re-export the drafter"))
    return out


# ------------------------------------------------------------------------------------------ loading and serving


def load(d, spec: DrafterSpec, embed_weight, head_weight, target, dtype) -> nn.Module:
    """The DFlash drafter of the export in ``d`` for the in-process harness, with the target's embedding and lm_head
    (given, or read from ``target``) where the export left them out."""
    sd = {name: t.to(dtype) if t.is_floating_point() else t for name, t in read_tensors(d).items()}
    if spec.draft_vocab_size == spec.vocab_size:  # the identity map is the module's own (not in its state_dict)
        sd.pop("d2t", None), sd.pop("t2d", None)
    elif "d2t" not in sd:
        raise ValueError(f"{d}: draft_vocab_size={spec.draft_vocab_size} < vocab_size={spec.vocab_size} but no d2t "
                         "tensor; re-export the drafter")
    elif "t2d" not in sd:  # vLLM does not need it; rebuild it from d2t
        sd["t2d"] = t2d_of(sd["d2t"], spec.vocab_size)
    load_head = lambda source: load_lm_head_rows(source, None, torch.arange(spec.vocab_size))  # noqa: E731
    for name, given, read in (("embed_tokens.weight", embed_weight, load_input_embeddings),
                              ("lm_head.weight", head_weight, load_head)):
        if name in sd:
            continue
        if given is None and target is not None:
            given = read(target)
        if given is None:
            raise ValueError(f"{d} has no {name}: pass the target (embed_weight=/head_weight= or target=)")
        sd[name] = given.to(dtype)
    model = build_drafter(spec)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{d}: tensors do not match the DFlash drafter (missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}); run `fledge lint` on it")
    return model


def block_size(config: Mapping) -> int | None:
    """The block the export was trained on (``dflash_config.block_size``, else the top level's); None if unwritten."""
    block = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size")
    return int(block) if block else None


def speculative_config(config: Mapping, model: str, k: int) -> dict:
    """vLLM's ``speculative_config`` for the export whose config.json is ``config``, at ``model``: its dflash method
    drafts the block in one forward. ``k`` is capped at ``block_size - 1``, the offsets training saw (vLLM drafts
    ``num_speculative_tokens`` slots whatever the block says)."""
    block = block_size(config)
    k = min(int(k), block - 1) if block else int(k)
    return {"method": "dflash", "model": str(model), "num_speculative_tokens": k}


# Where the DFlash objective's defaults come from (train/objectives/dflash.py, conf/drafter/dflash.yaml).
SOURCES = ("DFlash: Block Diffusion for Flash Speculative Decoding (arXiv 2602.06036): blocks of 16, one "
           "non-causal forward per block conditioned on the target's aux-layer states, offset k weighted "
           "exp(-(k-1)/gamma) with gamma 7; SpecForge's DFlash trainer: anchors drawn among the trained "
           "positions (512 per row). Fledge scores each offset with the soft cross-entropy against the "
           "target's distribution (distillation) where the paper uses the data's tokens.")


def card(config: Mapping, record: dict, repo_id: str, served: dict) -> tuple[list[str], list[str]]:
    """The card's own sections for a DFlash export (serving/card.py adds the measured ones) and its tags; ``served``
    is the speculative_config its command carries (serving_config.py's ``vllm_speculative_config``)."""
    dflash = config.get("dflash_config") or {}
    target = (record.get("target") or {}).get("name_or_path") or "<target>"
    block = block_size(config) or int(served["num_speculative_tokens"]) + 1
    spec_cfg = json.dumps(served)
    parts = [
        f"# {repo_id.split('/')[-1]}\n",
        f"A DFlash block drafter for **{target}**, trained with Fledge: one forward proposes a whole block of "
        "tokens, which the target verifies, so outputs are the target's own.\n",
        "## Drafter\n",
        f"- format: vLLM's DFlash layout ({', '.join(config.get('architectures') or [])}, "
        f"{config.get('num_hidden_layers')} Qwen3 layer(s))",
        f"- block size: {block} (serve at most {block - 1} speculative tokens)",
        f"- target layers (0-based, `dflash_config.target_layer_ids`): `{dflash.get('target_layer_ids')}`",
        f"- mask token id: {dflash.get('mask_token_id')}; " + (
            f"draft vocab: {config['draft_vocab_size']:,} of the target's {config['vocab_size']:,} ids (the target's "
            "lm_head rows and `d2t` shipped); the target's embedding is shared, not shipped"
            if config.get("draft_vocab_size") else "the target's embedding and lm_head are shared, not shipped"),
        f"- trained steps: {record.get('step')}",
        f"- objective: {SOURCES}\n",
        "## Serving\n",
        f"```bash\nvllm serve {target} --speculative-config '{spec_cfg}'\n```\n",
        "SGLang: not given; this export was served and measured with vLLM only.\n",
    ]
    return parts, ["speculative-decoding", "dflash", "drafter"]
