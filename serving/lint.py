"""Drafter linter: the silent failures that can be seen from files (docs/serving.md, Silent failures).

``lint_drafter(dir, target_config)`` checks an exported drafter (any dialect, ours or a public EAGLE-3)
against its target's config.json and, when present, the record of how it was trained
(models/drafter_checkpoint.py). Each finding says what is wrong and how to fix it; ``error`` means an engine
will load something that runs differently from training (or will not load it at all), ``warning`` means it
cannot be verified or is merely unusual. The aux ids are checked as each engine reads them
(serving/engine_aux.py): an engine the export's dialect is made for that would capture other layers than in
training is an error, another a warning.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fledge.atomic import read_json
from fledge.conf import compose
from fledge.conf.drafter_rules import drafter_problems
from fledge.conf.schema import default_aux_layer_ids
from fledge.models.drafter_checkpoint import RECORD, DrafterCheckpoint
from fledge.models.families import TargetShape, read_target, rope_of, text_config_dict
from fledge.models.layers.kind import kind_of_config
from fledge.models.weights import tensor_headers
from fledge.serving.dialects import dialect_of
from fledge.serving.engine_aux import ENGINES, captured_layers
from fledge.serving.export import load_target_config
from fledge.serving.export_reading import vocab_map_findings
from fledge.serving.layouts import layout_of
from fledge.serving.serving_config import expected_tensors, layer_config, parallel_drafting

_ST_DTYPE = {torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL"}
SIZE_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")  # every layer's, every dialect


@dataclass(frozen=True)
class Finding:
    level: str  # error | warning | note (what a user should know that needs no action: not counted as a warning)
    code: str  # short stable id, e.g. "aux-ids-start-1" (tests and CI grep for it)
    message: str
    fix: str


def format_findings(findings: list[Finding]) -> list[str]:
    return [f"{f.level.upper()} [{f.code}] {f.message}\n    fix: {f.fix}" for f in findings]


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


def lint_drafter(drafter_dir: str | Path, target_config: Any = None,
                 num_speculative_tokens: int | None = None) -> list[Finding]:
    """Every finding for the drafter in ``drafter_dir``; ``target_config`` (dict / PretrainedConfig) enables
    the checks against the target (RoPE, max positions, eps, vocab, aux-id range), read through the
    target's family (models/families.py); ``num_speculative_tokens``, the k of a serving command, is checked against
    what a block drafter was trained to draft (serving/layouts.py's ``speculative_config`` serves it with)."""
    d = Path(drafter_dir)
    out: list[Finding] = []

    def add(level: str, code: str, message: str, fix: str) -> None:
        out.append(Finding(level, code, message, fix))

    config = read_json(d / "config.json")
    if config is None:
        add("error", "no-config", f"{d}/config.json is missing", "export the drafter with Fledge's export stage")
        return out
    t = None
    if target_config is not None:
        try:
            t = read_target(target_config)[1]
        except ValueError as e:
            add("error", "target-config", f"cannot read the target's config: {e}",
                "give the target's config.json (--target), or register its family in fledge/models/families.py")
    record = DrafterCheckpoint.read_record(d)
    layout = layout_of(config)
    if layout is not None:  # not EAGLE's: its own checks, then the target's and the training record's
        for finding in layout.lint(d, config, t.num_hidden_layers if t is not None else None, record):
            add(*finding)
        # an MTP export's config.json is its target's own (serving/mtp_layout.py): no drafter layer to check
        drafter_layer = getattr(layout, "DRAFTER_LAYER", True)
        if t is not None:
            _check_against_target(config, t, add, drafter_layer)
        if record is not None and drafter_layer:
            _check_layer_trained(config, record, add)
        k = num_speculative_tokens
        served = k if k is None else layout.speculative_config(config, str(d), k)["num_speculative_tokens"]
        if served != k:
            add("error", "num-speculative-tokens", f"num_speculative_tokens={k}, but this drafter was trained to draft "
                f"{served} (vLLM drafts the k it is asked for: a DSpark block of another length, or DFlash slots past "
                "block_size - 1, were never trained)", f"serve it with num_speculative_tokens={served}, as the model "
                "card's command does")
        return out
    c = layer_config(config)
    missing = [key for key in SIZE_KEYS if not isinstance(c.get(key), int) or isinstance(c.get(key), bool)]
    if missing:  # nothing below can be checked, and no engine can build the layer
        add("error", "config-sizes", f"config.json (read as the {dialect_of(config).name} dialect) has no integer "
            f"{', '.join(missing)}", "re-export the drafter with Fledge, or copy the sizes from the target's config")
        return out
    _check_header(config, c, add)
    _check_aux_ids(c, t, record, add)
    _check_engine_readings(config, c, t, record, add)
    if t is not None:
        _check_against_target(c, t, add)
        kind = kind_of_config(c)
        for finding in kind.target_checks(c, text_config_dict(target_config)) if kind is not None else []:
            add(*finding)
    _check_flags(c, record, add, parallel_drafting(config))
    _check_layer_trained(c, record, add)
    _check_tensors(d, config, c, add)
    return out


def _check_header(config: dict, c: dict, add) -> None:
    dialect = dialect_of(config)
    archs = config.get("architectures") or []
    want = dialect.expected_architecture(c)
    if want not in archs:
        add("error", "architecture", f"architectures={archs}, expected [{want!r}]",
            f'set "architectures": ["{want}"] in config.json')
    for finding in dialect.header_checks(config):  # what only this dialect's loaders care about
        add(*finding)
    if int(c.get("num_hidden_layers") or 0) != 1:
        add("error", "num-layers", f"num_hidden_layers={c.get('num_hidden_layers')}, the drafter has one layer",
            'set "num_hidden_layers": 1')
    if c.get("tie_word_embeddings"):
        add("error", "tied", "tie_word_embeddings=true but the drafter's lm_head is its own [Vd, H] matrix",
            'set "tie_word_embeddings": false')
    dtype = c.get("torch_dtype") or c.get("dtype")
    if dtype != "bfloat16":
        add("warning", "config-dtype", f"torch_dtype={dtype!r}; the drafter is trained for bf16 serving",
            'set "torch_dtype": "bfloat16"')


# How to fix each broken aux-id / flag rule of fledge.conf.drafter_rules, in a serving config.json.
_FIXES = {
    "aux-ids-missing": "write eagle_config.eagle_aux_hidden_state_layer_ids (boundary convention)",
    "aux-ids-order": "retrain/export with ascending ids: engines feed fc the states in layer order",
    "aux-ids-start-1": "retrain/export with boundary ids (default (2, L//2, L-3)); if the ids really are 'output "
                       "of layer i', add 1 to each",
    "aux-ids-range": "use boundary ids in [1, L-1] of the target (default [2, L//2, L-3])",
    "fc-norm-and-norm-before-fc": "the two options exclude each other; keep the one the drafter was trained with",
}


def _check_aux_ids(c: dict, t: TargetShape | None, record: dict | None, add) -> None:
    ids = c.get("aux_layer_ids")
    L = t.num_hidden_layers if t is not None else None  # MTP layers excluded (families.py)
    for p in drafter_problems(list(ids or []), L, prefix=""):
        add("error", p.code, p.message, _FIXES[p.code])
    if not ids:
        return
    trained = (record or {}).get("trained_with", {}).get("aux_layer_ids")
    if trained is not None and list(trained) != list(ids):
        add("error", "aux-ids-trained", f"config says aux ids {ids} but the drafter was trained on {trained}",
            f"write {trained} in eagle_config.eagle_aux_hidden_state_layer_ids")


def _check_engine_readings(config: dict, c: dict, t: TargetShape | None, record: dict | None, add) -> None:
    """The layers each engine would capture for this config.json (serving/engine_aux.py) against those the
    drafter was trained on: an error for an engine the export's dialect is made for, else a note (every
    default export would otherwise warn about an engine nobody asked for; the card prints that engine's
    command only for a dialect made for it)."""
    dialect = dialect_of(config)
    L = t.num_hidden_layers if t is not None else c.get("target_num_hidden_layers")
    trained = (record or {}).get("trained_with", {}).get("aux_layer_ids")
    readings = {engine: captured_layers(engine, config, L) for engine in ENGINES}
    if trained is None:
        if len({tuple(r) for r in readings.values() if r is not None}) > 1:
            add("warning", "aux-ids-convention", "the engines read these aux ids differently ("
                + ", ".join(f"{e} captures {r}" for e, r in readings.items()) + f"), and without {RECORD} which "
                "one the drafter was trained on cannot be checked", "serve it with the engine it was trained for "
                "(boundary ids are vLLM's reading; SGLang adds 1 to each)")
        return
    for engine, got in readings.items():
        if got is None or got == list(trained):
            continue
        made_for = engine in dialect.engines
        if engine == "SGLang" and not made_for:
            fix = ("serve it with vLLM, or export it with export.format=sglang (no explicit ids: read right by both)"
                   if L is not None and list(trained) == default_aux_layer_ids(L) else
                   "serve it with vLLM: SGLang reads only the default ids (2, L//2, L-3) as trained")
        else:
            fix = (f"re-export it from its checkpoint with export.format={dialect.name} against this target "
                   f"(L={L}); the engine must capture {list(trained)}")
        add("error" if made_for else "note", f"aux-ids-{engine.lower()}",
            f"{engine} would capture the target's boundary layers {got} for this config.json, but the drafter "
            f"was trained on {list(trained)}: it would run on other states than in training", fix)


def _check_against_target(c: dict, t: TargetShape, add, drafter_layer: bool = True) -> None:
    theta, scaling = rope_of(c)
    if not math.isclose(theta, t.rope_theta, rel_tol=1e-6):
        add("error", "rope-theta", f"rope_theta={theta} but the target uses {t.rope_theta}",
            f"set rope_theta={t.rope_theta} (copy the target's RoPE)")
    if (scaling or {}) != (t.rope_scaling or {}):
        add("error", "rope-scaling", f"rope_scaling={scaling} but the target uses {t.rope_scaling}",
            f"set rope_scaling={t.rope_scaling} (and rope_parameters) from the target's config")
    mp = c.get("max_position_embeddings")
    if mp != t.max_position_embeddings:
        add("error", "max-positions", f"max_position_embeddings={mp} but the target has {t.max_position_embeddings}: "
            "engines cap or rescale the drafter's positions and long-context acceptance collapses",
            f"set max_position_embeddings={t.max_position_embeddings}")
    eps = c.get("rms_norm_eps")
    if eps is None or not math.isclose(float(eps), t.rms_norm_eps, rel_tol=1e-6):
        add("error", "rms-eps", f"rms_norm_eps={eps} but the target uses {t.rms_norm_eps}",
            f"set rms_norm_eps={t.rms_norm_eps}")
    heads = c.get("num_attention_heads")
    mine = {"num_attention_heads": heads, "num_key_value_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or (int(c["hidden_size"]) // int(heads) if heads else None),
            "hidden_act": c.get("hidden_act") or "silu"}
    for key, value in mine.items() if drafter_layer else ():  # read as engines read missing keys (kv = heads, ...)
        if value != getattr(t, key):
            add("warning", f"{key.replace('_', '-')}", f"{key}={value} differs from the target's {getattr(t, key)}",
                f"the drafter normally copies {key} from the target")
    if int(c.get("vocab_size") or 0) != t.vocab_size:
        add("error", "vocab-size", f"vocab_size={c.get('vocab_size')} but the target's vocab is {t.vocab_size}",
            f"set vocab_size={t.vocab_size} (the target's V; the draft vocab goes in draft_vocab_size)")
    Ht = int(c.get("target_hidden_size") or c["hidden_size"])
    if Ht != t.hidden_size:
        add("error", "target-hidden", f"target hidden size {Ht} (target_hidden_size or hidden_size) but the "
            f"target's is {t.hidden_size}", f"set target_hidden_size={t.hidden_size}")


def _check_flags(c: dict, record: dict | None, add, names_mask: bool) -> None:
    for p in drafter_problems(fc_norm=bool(c.get("fc_norm")), norm_before_fc=bool(c.get("norm_before_fc")), prefix=""):
        add("error", p.code, p.message, _FIXES[p.code])
    trained = (record or {}).get("trained_with")
    if not trained:
        add("warning", "no-training-record", f"no {RECORD}: whether norm_output matches training cannot be "
            "checked from files", "export with Fledge, or confirm how the checkpoint was trained")
        return
    spec = (record or {}).get("spec") or {}
    if spec.get("rope"):
        theta, scaling = rope_of({"rope_parameters": spec["rope"],
                                  "max_position_embeddings": spec.get("max_position_embeddings")})
        if (theta, scaling or {}) != (rope_of(c)[0], rope_of(c)[1] or {}):
            add("error", "rope-trained", f"config RoPE {rope_of(c)} differs from the RoPE the drafter was trained "
                f"with {(theta, scaling)}", "write the training RoPE (the target's) into config.json")
    if spec.get("max_position_embeddings") and c.get("max_position_embeddings") != spec["max_position_embeddings"]:
        add("error", "max-positions-trained", f"max_position_embeddings={c.get('max_position_embeddings')} but "
            f"the drafter was trained with {spec['max_position_embeddings']} (the target's)",
            f"set max_position_embeddings={spec['max_position_embeddings']}")
    parallel = trained.get("parallel_drafting")
    if parallel is not None and names_mask != bool(parallel):
        add("error", "parallel-drafting-mismatch", f"config.json {'names' if names_mask else 'has no'} "
            f"mask_token_id but the drafter was trained with parallel_drafting={bool(parallel)}: the engine "
            "would feed the draft steps otherwise than training did", "re-export it with Fledge")
    for key in ("fc_norm", "norm_output", "norm_before_fc"):
        if trained.get(key) is not None and bool(c.get(key)) != bool(trained[key]):
            add("error", f"{key.replace('_', '-')}-mismatch",
                f"config.json says {key}={bool(c.get(key))} but the drafter was trained with {key}="
                f"{bool(trained[key])}: the engine would run a different forward than training",
                f'set "{key}": {str(bool(trained[key])).lower()} in config.json')


def served_layer(c: dict) -> dict:
    """The drafter-layer settings an engine builds from config.json (``layer_config`` of any dialect), keys
    missing read the way vLLM and SGLang read them: kv heads = heads, head_dim = hidden / heads, hidden_act
    silu, target hidden size = hidden size, draft vocab = vocab. RoPE, max positions and flags are apart."""
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    kind = kind_of_config(c)
    own = {"layer": kind.name if kind else c.get("model_type"),
           **{k: c.get(k) for k in (kind.spec_keys if kind else ())}}
    return {**own, "hidden_size": hidden, "intermediate_size": c.get("intermediate_size"), "num_attention_heads": heads,
            "num_key_value_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or (int(hidden) // int(heads) if hidden and heads else None),
            "hidden_act": c.get("hidden_act") or "silu", "rms_norm_eps": c.get("rms_norm_eps"),
            "vocab_size": c.get("vocab_size"), "draft_vocab_size": c.get("draft_vocab_size") or c.get("vocab_size"),
            "target_hidden_size": c.get("target_hidden_size") or hidden}


def _check_layer_trained(c: dict, record: dict | None, add) -> None:
    """Every layer setting the engine reads from config.json against the DrafterSpec it was trained as (the
    record's ``spec``; RoPE, max positions and flags are _check_flags'). A mismatch runs another layer than
    training (a wrong rms_norm_eps or hidden_act loads and serves silently) whatever the target says."""
    spec = (record or {}).get("spec") or {}
    for key, served in served_layer(c).items():
        trained = spec.get(key)
        if trained is None:
            continue
        if key == "rms_norm_eps" and served is not None:
            same = math.isclose(float(served), float(trained), rel_tol=1e-6)
        else:
            same = served == trained
        if not same:
            add("error", f"{key.replace('_', '-')}-trained", f"config.json gives {key}={served!r} but the drafter "
                f"was trained with {key}={trained!r}: the engine would run a different layer than training",
                f"set {key}={trained!r} in config.json (or re-export the drafter)")


def _check_tensors(d: Path, config: dict, c: dict, add) -> None:
    try:
        headers = tensor_headers(d)
    except (OSError, ValueError, KeyError) as e:
        add("error", "no-weights", f"cannot read the safetensors in {d}: {e}", "re-export the drafter")
        return
    expected = expected_tensors(config, include_embed="embed_tokens.weight" in headers)
    V, Vd = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
    if Vd == V:  # public checkpoints may omit the maps when the draft vocab is the full vocab
        for name in ("d2t", "t2d"):
            if name not in headers:
                expected.pop(name)
    elif "t2d" not in headers:
        expected.pop("t2d")
        add("warning", "no-t2d", "t2d is missing (engines ignore it; training and the loader rebuild it from d2t)",
            "re-export with t2d for fine-tuning")
    for name in sorted(set(headers) - set(expected)):
        if name.startswith("fc_norm.") and not c.get("fc_norm"):
            add("error", "fc-norm-flag", f"{name} is present but config.json has fc_norm false: engines drop "
                "the per-aux norms and run EAGLE-3 on a 3.1 drafter", 'set "fc_norm": true')
        elif name == "input_norm.weight" and not c.get("norm_before_fc"):
            add("error", "norm-before-fc-flag", "input_norm.weight is present but norm_before_fc is not set",
                'set "norm_before_fc": true (and check fc_norm is false)')
        else:
            add("error", "unexpected-tensor", f"unexpected tensor {name} {headers[name][0]}",
                "remove it: vLLM's loader fails on names it does not know")
    for name, (shape, dtype) in expected.items():
        if name not in headers:
            add("error", "missing-tensor", f"missing tensor {name} {list(shape)}",
                "re-export the drafter (tensor names per docs/serving.md, The export)")
            continue
        got_shape, got_dtype = headers[name]
        if tuple(got_shape) != tuple(shape):
            add("error", "shape", f"{name} has shape {list(got_shape)}, the config implies {list(shape)}",
                "fix config.json (sizes copied from the target) or re-export the weights")
        if got_dtype != _ST_DTYPE[dtype]:
            level = "error" if name in ("d2t", "t2d") else "warning"
            add(level, "dtype", f"{name} is {got_dtype}, expected {_ST_DTYPE[dtype]}",
                f"cast {name} to {dtype} (d2t int64 offsets, t2d bool; weights bf16)")
    if "d2t" in headers:
        for finding in vocab_map_findings(d, V, Vd, headers):
            add(*finding)


def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The typed Config of ``conf/recipe/<recipe>.yaml`` (Hydra's compose API over conf/)."""

    return compose([f"recipe={recipe}", *(overrides or [])])


def resolve_target_config(target: str | None = None, recipe: str | None = None,
                          drafter_dir: str | Path | None = None) -> dict | None:
    """The target's config for the CLIs: ``target`` = a local dir, a config.json, or a hub id; else the
    recipe's target (its local dir or ``config_overrides``); else the target named in the export's record."""
    import json

    if recipe:

        return load_target_config(compose_recipe(recipe).target)
    if target is None and drafter_dir is not None:
        rec = DrafterCheckpoint.read_record(drafter_dir) or {}
        target = (rec.get("target") or {}).get("name_or_path")
    if not target:
        return None
    p = Path(target).expanduser()
    if p.is_file():
        return text_config_dict(json.loads(p.read_text()))
    if (p / "config.json").exists():
        return text_config_dict(json.loads((p / "config.json").read_text()))
    if p.is_dir() or target.startswith(("/", ".", "~")):
        raise ValueError(f"--target {target}: {'no config.json in that directory' if p.is_dir() else 'no such path'}; "
                         "give the target's model directory, its config.json, or a hub id (org/name)")
    from transformers import AutoConfig

    try:
        return text_config_dict(AutoConfig.from_pretrained(target))
    except OSError as e:  # not on the Hub, not in the cache offline, gated: transformers says which
        raise ValueError(f"--target {target}: {str(e).strip().splitlines()[0]}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fledge lint", description="Lint an exported drafter against its target: "
                                 "the silent failures docs/serving.md lists.")
    ap.add_argument("drafter_dir")
    ap.add_argument("--target", help="target: local dir, config.json, or hub id (default: from the export)")
    ap.add_argument("--recipe", help="take the target's config from conf/recipe/<name>.yaml")
    ap.add_argument("--num-speculative-tokens", type=int, metavar="K",
                    help="the k a serving command asks for: checked against what a block drafter was trained to draft")
    args = ap.parse_args(argv)
    target = resolve_target_config(args.target, args.recipe, args.drafter_dir)
    if target is None:
        print("note: no target config given or recorded; skipping the checks against the target")
    findings = lint_drafter(args.drafter_dir, target, args.num_speculative_tokens)
    for line in format_findings(findings):
        print(line)
    errors, warnings = (sum(f.level == level for f in findings) for level in ("error", "warning"))
    print(f"{args.drafter_dir}: {errors} error(s), {warnings} warning(s)")
    return 1 if has_errors(findings) else 0
