"""Which target layers each serving engine captures for an exported drafter's config.json.

Fledge trains on boundary ids (models/target.py: id k is the residual stream entering decoder layer k,
``hidden_states[k]`` of a transformers forward). The engines read ``eagle_aux_hidden_state_layer_ids``
differently, so the same config.json makes them feed the drafter different layers:

- vLLM 0.32 (its source in .engine/venv): ``GPUModelRunner._get_eagle3_aux_layers_from_config``
  (v1/worker/gpu_model_runner.py) takes the draft config's top-level ``eagle_aux_hidden_state_layer_ids``,
  else ``eagle_config``'s; none -> the model's ``get_eagle3_default_aux_hidden_state_layers`` = (2, L//2,
  L-3) (model_executor/models/interfaces.py). ``LlamaModel.forward`` (model_executor/models/llama.py)
  records id ``start_layer`` before the first layer and ``idx + 1`` after layer ``idx``: boundary ids.
- SGLang (sgl-project/sglang, python/sglang/srt/): ``ModelRunner.__init__`` (model_executor/
  model_runner.py) reads only ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` (None when absent);
  ``LlamaForCausalLM.set_eagle3_layers_to_capture`` (SGLang's srt/models/llama.py) keeps None's default [2, L//2, L-3]
  as is but adds 1 to every explicit id; ``LlamaModel.forward`` appends the state of layer i *before*
  layer i runs, i.e. boundary id i. So an explicit id k is captured as boundary k + 1, a default as itself.
  SGLang builds a draft model by its ``architectures`` name and has no ``Eagle3Speculator``: it does not
  serve the speculators format at all.

Hence the one config.json both engines read as trained is the one without explicit ids, for a drafter
trained on the default ids (the ``sglang`` export dialect, serving/dialects.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from fledge.conf.schema import default_aux_layer_ids

ENGINES = ("vLLM", "SGLang")


def _eagle_config_ids(config: Mapping) -> list[int] | None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def captured_layers(engine: str, config: Mapping, num_layers: int | None) -> list[int] | None:
    """The boundary ids ``engine`` captures, in the order it feeds them to fc (ascending layer order), for
    the drafter ``config`` beside a target of ``num_layers`` decoder layers; None when that cannot be
    told (the engine would use its default and ``num_layers`` is unknown) or the engine does not serve
    that format."""
    if engine == "vLLM":
        ids = config.get("eagle_aux_hidden_state_layer_ids") or _eagle_config_ids(config)
        if not ids:
            return None if num_layers is None else default_aux_layer_ids(num_layers)
        return sorted({int(i) for i in ids})  # EagleModelMixin._set_aux_hidden_state_layers sorts and dedups
    if engine == "SGLang":
        if config.get("speculators_model_type"):
            return None
        ids = _eagle_config_ids(config)
        if ids is None:
            return None if num_layers is None else default_aux_layer_ids(num_layers)
        # The layer loop appends each captured layer once, in order; one past the last layer is never reached.
        shifted = sorted({i + 1 for i in ids})
        return [i for i in shifted if num_layers is None or i < num_layers]
    raise ValueError(f"unknown serving engine {engine!r}: expected one of {ENGINES}")
