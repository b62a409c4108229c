"""Config composition: every recipe composes and validates offline; errors name the key."""

from pathlib import Path

import pytest

from fledge.conf import CONF_DIR, compose
from fledge.conf.schema import Config, default_aux_layer_ids

RECIPES = sorted(p.stem for p in Path(CONF_DIR, "recipe").glob("*.yaml"))


def test_shipped_recipes_are_the_promised_ones():
    assert {"tiny", "llama3", "qwen3"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    cfg = compose([f"recipe={recipe}"])
    assert isinstance(cfg, Config)
    assert cfg.recipe == recipe
    L = cfg.target.num_hidden_layers
    ids = cfg.aux_layer_ids()
    assert ids == default_aux_layer_ids(L) and len(set(ids)) == 3 and ids[0] != 1
    overrides = cfg.target.config_overrides
    if overrides:  # the written layer count must match the target's own config
        assert overrides["num_hidden_layers"] == L
        assert overrides["hidden_size"] == cfg.target.hidden_size
        assert overrides["vocab_size"] == cfg.target.vocab_size


@pytest.mark.parametrize("target", sorted(p.stem for p in Path(CONF_DIR, "target").glob("*.yaml")))
def test_target_sizes_are_written_once(target):
    """Where a target file carries config_overrides, its top-level sizes interpolate them (never a second copy)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR, "target", f"{target}.yaml")), resolve=False)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key in raw.get("config_overrides", {}):
            assert raw[key] == f"${{.config_overrides.{key}}}", (target, key, raw[key])


def test_one_size_override_moves_both_places():
    cfg = compose(["recipe=llama3", "target.config_overrides.num_hidden_layers=40"])
    assert cfg.target.num_hidden_layers == 40 and cfg.aux_layer_ids() == [2, 20, 37]


def test_llama3_aux_ids_are_boundary_convention():
    cfg = compose(["recipe=llama3"])
    assert cfg.aux_layer_ids() == [2, 16, 29]
    assert cfg.drafter.fc_norm and cfg.drafter.norm_output  # EAGLE-3.1 by default


def test_command_line_beats_recipe():
    cfg = compose(["recipe=tiny", "train.max_steps=7", "drafter=eagle3"])
    assert cfg.train.max_steps == 7
    assert not cfg.drafter.fc_norm and not cfg.drafter.norm_output


def test_missing_recipe_names_the_group():
    with pytest.raises(ValueError, match="recipe/nope"):
        compose(["recipe=nope"])


def test_unknown_key_and_bad_type_name_the_key():
    with pytest.raises(ValueError, match="bogus"):
        compose(["recipe=tiny", "drafter.bogus=1"])
    with pytest.raises(ValueError, match=r"drafter\.ttt_steps"):
        compose(["recipe=tiny", "drafter.ttt_steps=abc"])


@pytest.mark.parametrize("extra", ["+drafter.bogus=1", "+bogus=1", "+train.optim.nope=2"])
def test_a_plus_override_past_the_schema_is_refused_naming_the_key(extra):
    """Hydra lets `+key=value` add a key even to a structured config; it was set and ignored without a word."""
    key = extra[1:].split("=")[0]
    with pytest.raises(ValueError, match=f"^{key}: no such config key"):
        compose(["recipe=tiny", extra])
    compose(["recipe=tiny", "+eval.set_paths.my_set=/data/my_set.jsonl"])  # a free-form map takes any key


@pytest.mark.parametrize(
    "override, key",
    [
        ("drafter.ttt_steps=0", "drafter.ttt_steps"),
        ("drafter.norm_before_fc=true", "drafter.fc_norm"),
        ("drafter.aux_layer_ids=[1,4,5]", "drafter.aux_layer_ids"),
        ("drafter.aux_layer_ids=[2,4,40]", "drafter.aux_layer_ids"),
        ("drafter.aux_layer_ids=[4,2,5]", "drafter.aux_layer_ids"),
        ("drafter.draft_vocab_size=999999", "drafter.draft_vocab_size"),
        ("capture.dtype=int4", "capture.dtype"),
        ("drafter.loss_impl=fast", "drafter.loss_impl"),
        ("drafter.norm_impl=fast", "drafter.norm_impl"),
        ("run.stages=[prepare,bake]", "run.stages"),
        ("export.push_to_hub=true", "export.repo_id"),
    ],
)
def test_bad_values_are_value_errors_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        compose(["recipe=tiny", override])


@pytest.mark.parametrize("override, message", [
    ("train.eval_every=0", "train.eval_every=0: must be >= 1 (steps between held-out evals; the last step always "
                           "evaluates, so train.eval_every=train.max_steps evaluates once at the end)"),
    ("train.save_every=0", "train.save_every=0: must be >= 1 (steps between checkpoints"),
    ("train.log_every=0", "train.log_every=0: must be >= 1"),
    ("train.grad_accum=0", "train.grad_accum=0: must be >= 1"),
    ("train.micro_batch_tokens=0", "train.micro_batch_tokens=0: must be >= 1"),
    ("train.max_steps=-5", "train.max_steps=-5: must be >= 0 (optimizer steps; 0: train.epochs decides)"),
    ("capture.tensor_parallel_size=0", "capture.tensor_parallel_size=0: must be >= 1"),
    ("capture.engine_timeout_s=-1", "capture.engine_timeout_s=-1: must be >= 1"),
    ("eval.draft_tokens=0", "eval.draft_tokens=0: must be >= 1 (draft tokens per speculative round, k)"),
])
def test_counts_below_their_least_value_are_refused_when_composed(override, message):
    """Each composed and then failed after the model was built (a modulo by 0) or later still."""
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny", override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["eval.in_process=false"], "eval.in_process=false measures the prompt sets with the serving engine alone, "
                                "and eval.engine=hf is none: set eval.engine=vllm (or eval.in_process=true)"),
    (["eval.in_process=false", "eval.engine=vllm", "eval.context_buckets=[64,128]"],
     "eval.context_buckets=[64, 128]: AL vs context length is measured by the in-process harness, which "
     "eval.in_process=false skips: drop eval.context_buckets (or set eval.in_process=true)"),
])
def test_an_engine_only_eval_needs_an_engine_and_no_context_buckets(overrides, message):
    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny", *overrides])
    assert message in str(e.value)
    assert compose(["recipe=tiny", "eval.in_process=false", "eval.engine=vllm"]).eval.in_process is False


def test_the_real_target_is_evaluated_by_the_engine_alone_and_the_tiny_targets_in_process_too():
    """recipe=smollm2's in-process harness costs ~36 s a prompt on 2 cores; the tiny targets' is the reference."""
    assert compose(["recipe=smollm2"]).eval.in_process is False
    assert all(compose([f"recipe={r}"]).eval.in_process for r in ("tiny", "tiny_mla", "tiny_moe"))


def test_unsorted_aux_ids_are_refused_with_the_reason():
    """vLLM and SGLang collect aux states in layer order: [16, 2, 29] would feed fc's first block layer 2."""
    with pytest.raises(ValueError, match=r"drafter\.aux_layer_ids=\[16, 2, 29\]: must be distinct and ascending "
                                         r"\(\[2, 16, 29\]\); engines collect the aux states in layer order"):
        compose(["recipe=llama3", "drafter.aux_layer_ids=[16,2,29]"])
    with pytest.raises(ValueError, match="distinct and ascending"):
        compose(["recipe=llama3", "drafter.aux_layer_ids=[2,16,16]"])


def test_run_dir_does_not_depend_on_the_clock():
    a = compose(["recipe=tiny"])
    b = compose(["recipe=tiny"])
    assert a.run.name == b.run.name == "tiny"


def test_triton_norms_on_cpu_fail_before_any_work(tmp_path):
    import torch

    from fledge.pipeline.stages import train_inputs
    from fledge.run_layout import RunLayout
    from fledge.train.ttt_model import build_ttt_model

    cfg = compose(["recipe=tiny", "drafter.norm_impl=triton"])  # valid config: a GPU may run it
    with pytest.raises(ValueError, match="drafter.norm_impl=torch"):
        build_ttt_model(train_inputs(cfg), RunLayout(tmp_path).prepare.vocab, torch.device("cpu"))


def test_the_real_target_recipe_trains_with_muon():
    """recipe=smollm2 trains with Muon: AdamW learned less per step than speculators' own run on the same store and
    budget, and Muon matched it (recipes/smollm2/README.md, Against the peer)."""
    cfg = compose(["recipe=smollm2"])
    assert cfg.train.optim.name == "muon" and cfg.train.max_steps == 1600
    assert compose(["recipe=tiny"]).train.optim.name == "adamw"
