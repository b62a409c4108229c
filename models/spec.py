"""The drafter spec: the shapes every drafter shares (``DrafterSpec``), one subclass per algorithm, and the registry
that finds an algorithm's entry from a config, a spec or a spec's JSON.

An algorithm is one module (models/eagle.py, models/peagle.py, models/dflash.py) holding its spec class, with the
fields only its drafters have, and registering its :class:`Algorithm`; models/algorithms.py imports them all, so
import the registry's users (``DrafterSpec``, ``build_drafter``) from there. A config picks its spec class by two
keys, ``drafter.algorithm`` and ``drafter.parallel_drafting`` (:meth:`DrafterSpec.selected_by`), the keys users
have always written: P-EAGLE is ``algorithm: eagle`` with ``parallel_drafting: true``.

A spec is written as one flat JSON object whatever its class (:meth:`DrafterSpec.to_dict`: checkpoints' fledge.json,
exports' fledge_training.json), the object every Fledge version wrote: a class writes the keys it does not hold at
:data:`FLAT_DEFAULTS`, and reading one back refuses such a key at another value rather than drop it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn
from transformers import LlamaConfig

from fledge.conf.drafter_rules import drafter_problems, raise_problems
from fledge.models.families import TargetFamily, read_target, rope_of, text_config_dict
from fledge.models.layers.kind import LAYER_KINDS, LayerKind, get_layer_kind, layer_settings, resolve_layer_kind
from fledge.registry import Registry

DEFAULT_ALGORITHM = "eagle"  # what a config or spec without drafter.algorithm means (written before DFlash)
# The flat JSON's keys that some spec classes do not hold, at the value such a class writes (and reads back).
FLAT_DEFAULTS: dict[str, Any] = {"fc_norm": False, "norm_output": False, "norm_before_fc": False,
                                 "parallel_drafting": False, "mask_token_id": None, "num_draft_layers": 1,
                                 "block_size": 0}


def option(drafter: Any, key: str, default: Any = None) -> Any:
    """``drafter``'s ``key``: a DrafterConfig's, a spec's, a spec dict's or any namespace's."""
    return drafter.get(key, default) if isinstance(drafter, Mapping) else getattr(drafter, key, default)


@dataclass(frozen=True)
class Algorithm:
    """One drafter algorithm: its spec class, the drafter module it builds and how vLLM serves it."""

    name: str  # the registry's name, which every layer's registry keys its part on
    spec: type[DrafterSpec]
    build: Callable[..., nn.Module]  # (spec, attention=..., norm_impl=...) -> the drafter module
    vllm_method: str  # vLLM's speculative_config "method"
    block: bool  # drafts all k tokens in one forward without feeding a draft back (the proposer's loop)
    target_head: bool = False  # scores with the target's lm_head (loaded from the target, not the export)
    vllm_cpu: bool = True  # vLLM's CPU build serves its method (vLLM 0.32 runs dspark in its V2 GPU runner only)
    title: str = ""  # how a report names it ("": EAGLE's, named EAGLE-3 / EAGLE-3.1 by the spec's flags)
    rounds: str = "a chain of k={k} drafts"  # what one drafting round is, as a report says it


ALGORITHMS: Registry[Algorithm] = Registry("drafter.algorithm", "models/algorithms.py (a module per algorithm)")


def algorithm_of(drafter: Any) -> Algorithm:
    """The algorithm of a spec, a DrafterConfig or anything carrying their ``algorithm`` / ``parallel_drafting``
    (a spec's dict, a stage's inputs); ValueError naming both keys when no registered algorithm is it."""
    for algorithm in ALGORITHMS.values():
        if algorithm.spec.selected_by(drafter):
            return algorithm
    name, parallel = option(drafter, "algorithm", DEFAULT_ALGORITHM), bool(option(drafter, "parallel_drafting"))
    raise ValueError(f"drafter.algorithm={name!r} with drafter.parallel_drafting={str(parallel).lower()}: no drafter "
                     f"algorithm is registered as that ({ALGORITHMS.names()}, in {ALGORITHMS.where})")


@dataclass
class DrafterSpec:
    """Shapes of a drafter, the fields of every algorithm; a subclass per algorithm adds its own (JSON-safe via
    ``to_dict`` / ``from_dict``). ``algorithm`` and ``parallel_drafting`` are the config's values that select the
    class."""

    algorithm: ClassVar[str]
    parallel_drafting: ClassVar[bool] = False

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_num_hidden_layers: int
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    layer: str = "llama"  # drafter layer kind (models/layers/)
    # MLA widths (layer "mla" only; models/layers/): null q_lora_rank = a plain q_proj
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        self.validate()

    # ---- the class of a config ---------------------------------------------------------------------------
    @classmethod
    def selected_by(cls, drafter: Any) -> bool:
        """Whether a config (or a spec, or its dict) is of this class: its ``algorithm`` and ``parallel_drafting``."""
        return (option(drafter, "algorithm", DEFAULT_ALGORITHM) == cls.algorithm
                and bool(option(drafter, "parallel_drafting", False)) == cls.parallel_drafting)

    @classmethod
    def layer_kind(cls, family: TargetFamily, drafter: Any) -> LayerKind:
        """The drafter layer's kind: ``drafter.layer``, auto being the target family's."""
        if family.layer_kind not in LAYER_KINDS:
            raise ValueError(f"target family {family.name!r} needs drafter layer kind {family.layer_kind!r}, which "
                             f"models/layers/ does not register (it has {sorted(LAYER_KINDS)})")
        return resolve_layer_kind(option(drafter, "layer", "auto"), family.layer_kind)

    @classmethod
    def config_fields(cls, drafter: Any, hf_config: Any, vocab_size: int) -> dict[str, Any]:
        """This class's own fields (and ``draft_vocab_size``) from the drafter config, for the target of
        ``hf_config`` with ``vocab_size`` tokens."""
        return {"draft_vocab_size": option(drafter, "draft_vocab_size")}

    @classmethod
    def from_target_config(cls, hf_config, drafter_cfg, aux_layer_ids) -> DrafterSpec:
        """Spec for a drafter of the target whose HF config is ``hf_config`` (a PretrainedConfig or dict), of the
        class ``drafter_cfg`` selects (whichever class this is called on).

        The target's family (models/families.py) reads the config and gives the drafter layer's settings,
        the same ones the serving config writes. ``drafter_cfg`` is a ``DrafterConfig`` (or anything with
        its keys); ``aux_layer_ids`` are boundary ids.
        """
        steps = option(drafter_cfg, "ttt_steps", 1)
        if steps < 1:
            raise ValueError(f"drafter.ttt_steps={steps}: must be >= 1")
        family, shape = read_target(hf_config)
        spec_class = algorithm_of(drafter_cfg).spec
        kind = spec_class.layer_kind(family, drafter_cfg)
        layer = layer_settings(kind, family.drafter_layer(shape), text_config_dict(hf_config))
        theta, scaling = rope_of(layer)
        return spec_class(
            hidden_size=int(layer["hidden_size"]),
            target_hidden_size=shape.hidden_size,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=int(layer["num_attention_heads"]),
            num_key_value_heads=int(layer["num_key_value_heads"]),
            head_dim=int(layer["head_dim"]),
            rms_norm_eps=float(layer["rms_norm_eps"]),
            hidden_act=layer["hidden_act"],
            vocab_size=shape.vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            target_num_hidden_layers=shape.num_hidden_layers,
            max_position_embeddings=int(layer["max_position_embeddings"]),
            rope=_json_safe({**(scaling or {"rope_type": "default"}), "rope_theta": theta}),
            layer=kind.name,
            **spec_class.config_fields(drafter_cfg, hf_config, shape.vocab_size),
            **{k: layer[k] for k in kind.spec_keys},
        )

    # ---- rules ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the offending field. The aux-id and flag rules are the config's
        (fledge.conf.drafter_rules), except that a list starting with 1 is accepted: a spec may describe a
        public checkpoint written that way, which can still be loaded and measured (config, export and lint
        refuse it)."""
        problems = drafter_problems(self.aux_layer_ids, self.target_num_hidden_layers, **self._flag_rules(),
                                    draft_vocab_size=self.draft_vocab_size, vocab_size=self.vocab_size)
        raise_problems(problems, skip=("aux-ids-start-1",))
        kind = get_layer_kind(self.layer)
        problems = [p for p in kind.checks(self.to_dict()) if p[0] == "error"]
        if problems:
            raise ValueError(problems[0][2])
        self._validate_own()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    def _flag_rules(self) -> dict[str, bool]:
        """The norm flags conf/drafter_rules.py checks (a class with none: none)."""
        return {}

    def _validate_own(self) -> None:
        """The class's own fields' rules."""

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    # ---- JSON ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The flat JSON object (module docstring)."""
        own = {"algorithm": self.algorithm, "parallel_drafting": self.parallel_drafting}
        return _json_safe({**FLAT_DEFAULTS, **dataclasses.asdict(self), **own})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DrafterSpec:
        """The spec a :meth:`to_dict` object describes, of the class its ``algorithm`` and ``parallel_drafting``
        select (whichever class this is called on)."""
        algorithm = algorithm_of(d)
        own = {f.name for f in dataclasses.fields(algorithm.spec)}
        unknown = set(d) - own - set(FLAT_DEFAULTS) - {"algorithm"}
        if unknown:
            raise ValueError(f"DrafterSpec.from_dict: unknown keys {sorted(unknown)}")
        foreign = {k: d[k] for k in set(d) & set(FLAT_DEFAULTS) - own - {"parallel_drafting"}
                   if d[k] != FLAT_DEFAULTS[k]}
        if foreign:
            raise ValueError(f"DrafterSpec.from_dict: {foreign} set, which a drafter of algorithm "
                             f"{algorithm.name} does not have")
        return algorithm.spec(**{k: v for k, v in d.items() if k in own})

    def layer_config(self) -> LlamaConfig:
        """A LlamaConfig carrying the target's RoPE and MLP settings, for transformers' own modules (RoPE
        spans the kind's ``rope_dim``: an MLA layer's qk_rope_head_dim)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=get_layer_kind(self.layer).rope_dim(self),
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope),
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
        )


def mask_token_id_for(drafter_cfg, hf_config, vocab_size: int) -> int:
    """The token a draft slot is fed (P-EAGLE's parallel slots, a DFlash block's masks): ``drafter.mask_token_id``,
    else the target's pad id, else its eos id (the engine embeds it with the target's frozen embedding)."""
    given = option(drafter_cfg, "mask_token_id")
    if given is not None:
        return int(given)
    config = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    for key in ("pad_token_id", "eos_token_id"):
        value = config.get(key)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    raise ValueError("drafter.parallel_drafting / drafter.algorithm=dflash: the target's config has no pad_token_id "
                     "or eos_token_id to fill the draft slots with; set drafter.mask_token_id")


def check_mask_token(spec: DrafterSpec, why: str) -> None:
    """ValueError unless ``spec.mask_token_id`` is a target-vocab id; ``why``: what the drafter feeds it to."""
    mask = spec.mask_token_id
    if not (mask is not None and 0 <= mask < spec.vocab_size):
        raise ValueError(f"drafter.mask_token_id={mask}: {why} a target-vocab id, in [0, {spec.vocab_size}); set one "
                         "in that range")


def _json_safe(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
