"""Export dialects: how a serving directory spells a drafter for an engine (an extension point).

The drafter's state_dict already uses the HF/EAGLE names (``fc.weight``, ``midlayer.*``, ``lm_head.weight``,
``d2t``, ...). A dialect says how one serving format differs: its ``architectures`` name, how config.json is
built from the drafter layer's settings plus the Eagle-3 fields (and read back), the prefix of the decoder
layer's tensors, the header checks the linter adds, and the command lines that serve it. Export, load,
lint, the Hub model card and the pipeline's ``export.format`` check all read ``DIALECTS``; adding a dialect
is one ``register_dialect`` here plus its test (tests/unit/serving/test_dialects.py).

- ``hf``: the HF/EAGLE layout vLLM and SGLang load as a draft model (``LlamaForCausalLMEagle3``,
  ``midlayer.*``, aux ids in ``eagle_config``, boundary ids as vLLM reads them; SGLang would read each
  one layer deeper, so its card gives no SGLang command). Also what a config no dialect recognises is
  read as (public EAGLE-3 checkpoints), so the linter reports what is off instead of failing to read it.
- ``sglang``: the ``hf`` layout without explicit aux ids, the one config.json SGLang and vLLM both read
  as trained (serving/engine_aux.py: SGLang adds 1 to every explicit id, while both engines' default is
  the (2, L//2, L-3) Fledge trains on by default). Only a drafter trained on the default ids has it;
  ``target_num_hidden_layers`` records the depth those defaults resolve against, for Fledge's readers.
- ``speculators``: vLLM's speculators format, which ``vllm serve <dir>`` runs alone (``Eagle3Speculator``,
  the layer settings nested in ``transformer_layer_config``, ``layers.0.*``). It sets
  ``norm_before_residual: false`` explicitly: vLLM's adapter reads a missing key as true, which is not the
  EAGLE-3 layer Fledge trains (``u = hidden_norm(g)``, residual = raw ``g``). A P-EAGLE drafter is written
  as ``speculators_model_type: peagle``, which vLLM serves with ``parallel_drafting`` (``eagle3`` would not).

Every vLLM command a dialect prints carries the speculative_config the eval stage sends vLLM, as it is
(serving_config.py's ``vllm_speculative_config``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fledge.conf.schema import default_aux_layer_ids
from fledge.models.layers.kind import DEFAULT_KIND, get_layer_kind, kind_of_architecture, kind_of_config
from fledge.registry import Registry
from fledge.serving.export_reading import Finding

TRAINING_PREFIX = "midlayer."  # the decoder layer's prefix in the drafter's own state_dict
# Keys read back under the HF dialect's names, whatever the dialect (layer keys come along unnamed).
EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "fc_norm", "norm_output", "norm_before_fc", "mask_token_id")


@dataclass(frozen=True)
class ServingFields:
    """What every dialect writes: the drafter layer's settings and the Eagle-3 fields."""

    layer: dict  # the drafter layer's config keys (families.py's drafter_layer, with the drafter's widths)
    flags: dict  # fc_norm and norm_output always, norm_before_fc only when true
    aux_layer_ids: list[int]  # boundary convention (docs/architecture.md, Aux layer ids)
    draft_vocab_size: int
    target_hidden_size: int | None  # set only when the drafter is narrower than its target
    target_name: str | None  # hub id or path of the target
    target_architectures: list[str]
    speculative_tokens: int
    target_num_hidden_layers: int | None = None  # the target's L (MTP layers excluded)


@dataclass(frozen=True)
class Dialect:
    """One serving format. ``read`` returns the layer keys with the Eagle-3 fields merged in under
    EAGLE_KEYS' names plus ``aux_layer_ids`` (and ``target_name`` when the format records the target);
    ``commands(served, target)`` returns {engine: command line or a note}, ``served`` being the vLLM
    ``speculative_config`` of the export (serving_config.py's ``vllm_speculative_config``, the eval stage's
    request), which every vLLM command carries as it is; ``header_checks(config)`` returns findings beyond the
    architecture name."""

    name: str
    architecture: str
    layer_prefix: str
    build: Callable[[ServingFields], dict]
    read: Callable[[Mapping], dict]
    detect: Callable[[Mapping], bool]
    commands: Callable[[dict, str], dict[str, str]]
    header_checks: Callable[[Mapping], list[Finding]] = lambda config: []
    architecture_of: Callable[[Mapping], str] | None = None  # per config (the hf dialect: per layer kind)
    # The engines (serving/engine_aux.py ENGINES) this format is made for: an engine among them that would
    # capture other layers than the drafter was trained on is a lint error, any other engine a warning.
    engines: tuple[str, ...] = ()
    # ``check_aux_ids(aux_layer_ids, num_hidden_layers)``: ValueError when the format cannot carry these ids
    # (the sglang form carries only the default ones); None: any ids.
    check_aux_ids: Callable[[list[int], int | None], None] | None = None

    def expected_architecture(self, config: Mapping) -> str:
        """The ``architectures`` entry this dialect writes for ``config``."""
        return self.architecture_of(config) if self.architecture_of else self.architecture

    def to_serving_name(self, name: str) -> str:
        """A drafter state_dict name -> this dialect's tensor name."""
        if name.startswith(TRAINING_PREFIX):
            return self.layer_prefix + name[len(TRAINING_PREFIX):]
        return name

    def from_serving_name(self, name: str) -> str:
        """This dialect's tensor name -> the drafter state_dict name."""
        if name.startswith(self.layer_prefix):
            return TRAINING_PREFIX + name[len(self.layer_prefix):]
        return name


DIALECTS: Registry[Dialect] = Registry("export.format", "serving/dialects.py")
FALLBACK = "hf"


def register_dialect(dialect: Dialect, replace: bool = False) -> Dialect:
    """Add ``dialect`` under its name (an existing one is kept unless ``replace``)."""
    return DIALECTS.register(dialect.name, dialect, replace=replace)


def get_dialect(name: str) -> Dialect:
    """The dialect ``export.format`` names; ValueError listing the registered ones otherwise."""
    return DIALECTS.get(name)


def dialect_of(config: Mapping) -> Dialect:
    """The dialect of an exported config.json: the first other than the fallback that recognises it, else
    ``hf`` (public EAGLE-3 checkpoints carry assorted architecture names)."""
    for d in DIALECTS.values():
        if d.name != FALLBACK and d.detect(config):
            return d
    return DIALECTS.get(FALLBACK)


def names() -> list[str]:
    """Registered dialect names (the values ``export.format`` accepts)."""
    return DIALECTS.names()


def serving_commands(dialect: Dialect, served: dict, target: str) -> str:
    """A markdown bash block with the dialect's command line per engine (hub model card); ``served``: the vLLM
    speculative_config of the export (serving_config.py's ``vllm_speculative_config``)."""
    lines = []
    for engine, cmd in dialect.commands(served, target).items():
        lines += [f"# {engine}", cmd, ""]
    return "```bash\n" + "\n".join(lines).rstrip() + "\n```"


# ---------------------------------------------------------------------------------------------- hf


def _hf_architecture(config: Mapping) -> str:
    """The layer kind's architecture (models/layers/), by the config's model_type; llama's when unknown."""
    kind = kind_of_config(config) or get_layer_kind(DEFAULT_KIND)
    return kind.architecture


def _hf_build(f: ServingFields) -> dict:
    cfg = {"architectures": [_hf_architecture(f.layer)], **f.layer, "draft_vocab_size": int(f.draft_vocab_size),
           **f.flags, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(f.aux_layer_ids),
                                       "use_aux_hidden_state": True}}
    if f.target_hidden_size is not None:
        cfg["target_hidden_size"] = f.target_hidden_size
    return cfg


def _hf_read(config: Mapping) -> dict:
    out = dict(config)
    out["aux_layer_ids"] = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return out


def _hf_checks(config: Mapping) -> list[Finding]:
    # vLLM builds the layer through the transformers config of model_type: it must be the kind's
    kind, by_arch = kind_of_config(config), kind_of_architecture(config.get("architectures") or [])
    if kind is None or (by_arch is not None and by_arch is not kind):
        want = (by_arch or get_layer_kind(DEFAULT_KIND)).model_type
        return [("error", "model-type", f"model_type={config.get('model_type')!r} does not match architectures="
                 f"{config.get('architectures')}", f'set "model_type": "{want}"')]
    return kind.checks(config)


def _vllm_command(served: dict, target: str) -> str:
    return f"vllm serve {target} --speculative-config '{json.dumps(served)}'"


# Why a P-EAGLE export gets no SGLang command: SGLang's EAGLE3 worker drafts step by step, a chain drafter.
SGLANG_PARALLEL_NOTE = ("# not this export: it is a P-EAGLE drafter, trained to draft all k tokens in one forward "
                        "(vLLM's parallel_drafting);\n# SGLang has no parallel drafting for EAGLE drafters and would "
                        "run it as a chain drafter, feeding its steps otherwise than training did")


def _sglang_command(served: dict, target: str) -> str:
    if served.get("parallel_drafting"):
        return SGLANG_PARALLEL_NOTE
    k = int(served["num_speculative_tokens"])
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\\n"
            f"    --speculative-draft-model-path {served['model']} --speculative-num-steps {k} \\\n"
            f"    --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


# Why an export with explicit aux ids gets no SGLang command (serving/engine_aux.py).
SGLANG_SHIFT_NOTE = ("# not this export: SGLang adds 1 to every explicit eagle_aux_hidden_state_layer_ids entry and "
                     "would feed the drafter\n# other layers than it was trained on; export.format=sglang writes the "
                     "one it reads right (default aux ids)")


def _hf_commands(served: dict, target: str) -> dict[str, str]:
    return {"vLLM": _vllm_command(served, target), "SGLang": SGLANG_SHIFT_NOTE}


# ------------------------------------------------------------------------------------- speculators


def _speculators_build(f: ServingFields) -> dict:
    kind = kind_of_config(f.layer)
    if kind is not None and not kind.speculators:
        raise ValueError(f"export.format=speculators has no {kind.name!r} drafter layer (speculators 0.9.0 and "
                         "vLLM's adapter of it build only llama and qwen3 layers): use export.format=hf")
    if not f.target_name:
        raise ValueError("the speculators dialect needs the target's name_or_path (speculators_config.verifier): "
                         "set target.name_or_path")
    algorithm = speculators_algorithm(f.flags)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(f.speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": f.target_name, "architectures": list(f.target_architectures)},
        },
        # Flags duplicated inside: vLLM's adapter forwards only transformer_layer_config's keys to the model.
        "transformer_layer_config": {**f.layer, **f.flags},
        "draft_vocab_size": int(f.draft_vocab_size),
        "target_hidden_size": f.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(f.aux_layer_ids),
        **f.flags,
        "torch_dtype": "bfloat16",
    }


def speculators_algorithm(config: Mapping) -> str:
    """The ``speculators_model_type`` of a drafter whose flags (or config.json) are ``config``: ``peagle`` for a
    P-EAGLE one (it names a ``mask_token_id``), the one from which ``vllm serve DIR`` builds ``parallel_drafting``
    (vLLM 0.32's SpeculatorsConfig; from ``eagle3`` it would run the drafter as a chain drafter), else ``eagle3``."""
    return "peagle" if config.get("mask_token_id") is not None else "eagle3"


def _speculators_read(config: Mapping) -> dict:
    out = dict(config.get("transformer_layer_config") or {})
    for key in EAGLE_KEYS:
        if config.get(key) is not None:
            out[key] = config[key]
    out["aux_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        out["target_name"] = verifier["name_or_path"]
    return out


def _speculators_checks(config: Mapping) -> list[Finding]:
    layer = config.get("transformer_layer_config") or {}
    kind = kind_of_config(layer)
    if kind is None or not kind.speculators:
        return [("error", "model-type", f"transformer_layer_config.model_type={layer.get('model_type')!r}: vLLM's "
                 "speculators adapter maps only llama and qwen3", "export with export.format=hf")]
    want, got = speculators_algorithm(_speculators_read(config)), config.get("speculators_model_type")
    if got != want:
        why = ("it names a mask_token_id (a P-EAGLE drafter): from any other type `vllm serve DIR` runs it as a "
               "chain drafter, without parallel_drafting" if want == "peagle" else "it names no mask_token_id, "
               "which vLLM's peagle reader requires (a P-EAGLE drafter's parallel-slot token)")
        return [("error", "speculators-model-type", f"speculators_model_type={got!r} but {why}",
                 f'set "speculators_model_type": "{want}" (re-export with Fledge)')]
    if want == "peagle" and config.get("mask_token_id") is None:
        return [("error", "speculators-mask-token", "mask_token_id is only in transformer_layer_config: vLLM's peagle "
                 "reader takes it from the top level", "copy mask_token_id to the top level (re-export with Fledge)")]
    if config.get("norm_before_residual") is not False:
        return [("error", "norm-before-residual",
                 f"norm_before_residual={config.get('norm_before_residual')!r}: vLLM's speculators adapter reads a "
                 "missing key as true, which is not the layer Fledge trains", 'set "norm_before_residual": false')]
    return kind.checks(layer)


def _speculators_commands(served: dict, target: str) -> dict[str, str]:
    return {
        "vLLM": _vllm_command(served, target),
        "vLLM, the drafter alone (the target from speculators_config.verifier, k from its proposal_methods)":
            f"vllm serve {served['model']}",
        "SGLang": "# export with export.format=sglang: the hf layout with the aux ids SGLang reads right",
    }


# ------------------------------------------------------------------------------------------ sglang


def _check_sglang_ids(aux_layer_ids: list[int], num_hidden_layers: int | None) -> None:
    L = num_hidden_layers
    if L is None or list(aux_layer_ids) != default_aux_layer_ids(L):
        default = default_aux_layer_ids(L) if L else "(2, L//2, L-3)"
        raise ValueError(
            f"export.format=sglang with aux layer ids {list(aux_layer_ids)}: SGLang adds 1 to every id a config.json "
            f"lists, so this form lists none, and both engines then capture their default {default}, not these "
            "ids: serve this drafter with vLLM (export.format=hf), or train it on the default drafter.aux_layer_ids")


def _sglang_build(f: ServingFields) -> dict:
    _check_sglang_ids(f.aux_layer_ids, f.target_num_hidden_layers)
    cfg = _hf_build(f)
    cfg["eagle_config"] = {"use_aux_hidden_state": True}
    cfg["target_num_hidden_layers"] = int(f.target_num_hidden_layers)
    return cfg


def _sglang_read(config: Mapping) -> dict:
    out = _hf_read(config)
    out["aux_layer_ids"] = default_aux_layer_ids(int(config["target_num_hidden_layers"]))
    return out


def _sglang_detect(config: Mapping) -> bool:
    return (kind_of_architecture(config.get("architectures") or []) is not None
            and isinstance(config.get("target_num_hidden_layers"), int)
            and "eagle_aux_hidden_state_layer_ids" not in (config.get("eagle_config") or {}))


def _sglang_commands(served: dict, target: str) -> dict[str, str]:
    return {"vLLM": _vllm_command(served, target), "SGLang": _sglang_command(served, target)}


def check_export_format(fmt: str, aux_layer_ids: list[int], num_hidden_layers: int) -> None:
    """``export.format`` names a dialect, and one that can carry the drafter's aux ids (the sglang form
    only the default ids): ValueError before any stage runs, not after training."""
    dialect = get_dialect(fmt)
    if dialect.check_aux_ids is not None:
        dialect.check_aux_ids(aux_layer_ids, num_hidden_layers)


register_dialect(Dialect("hf", "LlamaForCausalLMEagle3", "midlayer.", _hf_build, _hf_read,
                         detect=lambda c: kind_of_architecture(c.get("architectures") or []) is not None,
                         commands=_hf_commands, header_checks=_hf_checks, architecture_of=_hf_architecture,
                         engines=("vLLM",)))
register_dialect(Dialect("speculators", "Eagle3Speculator", "layers.0.", _speculators_build, _speculators_read,
                         detect=lambda c: bool(c.get("speculators_model_type")),
                         commands=_speculators_commands, header_checks=_speculators_checks, engines=("vLLM",)))
register_dialect(Dialect("sglang", "LlamaForCausalLMEagle3", "midlayer.", _sglang_build, _sglang_read,
                         detect=_sglang_detect, commands=_sglang_commands, header_checks=_hf_checks,
                         architecture_of=_hf_architecture, engines=("vLLM", "SGLang"), check_aux_ids=_check_sglang_ids))
