"""The one registry shape of every extension point (fledge/registry.py), and the one table of config keys
that name registry entries, checked by every entry point (pipeline/preflight.py)."""

import pytest

from fledge.registry import Registry


def test_register_get_names_and_the_message_naming_key_and_file():
    r = Registry("drafter.loss", "train/losses", reserved=("auto",))
    r.register("b", 2)

    @r.register("a")
    def a():
        return 1

    assert r.get("a") is a and r.get("b") == 2 and r.names() == ["a", "b"] and "a" in r and list(r) == ["a", "b"]
    with pytest.raises(ValueError, match=r"^drafter\.loss='c': expected one of \['auto', 'a', 'b'\] \(a new one "
                                         r"is registered in train/losses\)$"):
        r.get("c")
    r.check("auto")  # reserved: a valid value, not an entry
    with pytest.raises(ValueError, match="reserved"):
        r.register("auto", 3)
    with pytest.raises(ValueError, match="already registered"):
        r.register("b", 3)
    r.register("b", 3, replace=True)
    assert r.get("b") == 3


def test_temporary_entry_is_gone_after_the_block_and_what_it_replaced_comes_back():
    r = Registry("export.format", "serving/dialects.py")
    r.register("hf", "built-in")
    with r.temporary("test", "t"), r.temporary("hf", "patched"):
        assert r.get("test") == "t" and r.get("hf") == "patched"
    assert "test" not in r and r.get("hf") == "built-in"
    with pytest.raises(RuntimeError), r.temporary("test", "t"):
        raise RuntimeError("a failing test")
    assert "test" not in r


def test_every_extension_point_is_a_registry_and_the_table_names_each_config_key():
    from fledge.evaluation.eval_sets import EVAL_SETS
    from fledge.models.families import FAMILIES
    from fledge.models.layers.kind import LAYER_KINDS
    from fledge.pipeline.preflight import CONFIG_REGISTRIES
    from fledge.serving.dialects import DIALECTS
    from fledge.train.losses import LOSSES

    assert all(isinstance(r, Registry) for r in (EVAL_SETS, FAMILIES, LAYER_KINDS, DIALECTS, LOSSES))
    assert set(CONFIG_REGISTRIES.values()) == {EVAL_SETS, LAYER_KINDS, DIALECTS, LOSSES}  # families: by model_type
    for key, registry in CONFIG_REGISTRIES.items():
        assert registry.key == key  # the message names the key the table checks


@pytest.mark.parametrize("override,needle", [("drafter.loss=nope", "drafter.loss='nope'"),
                                              ("drafter.layer=gpt", "drafter.layer='gpt'"),
                                              ("export.format=gguf", "export.format='gguf'"),
                                              ("eval.sets=[default,mtbench]", "eval.sets='mtbench'")])
def test_every_entry_point_refuses_a_name_no_registry_holds(override, needle):
    """`fledge run` (train/main.py), `fledge config` and `fledge submit` compose through the same checks."""
    import argparse

    from fledge.conf import compose
    from fledge.pipeline.preflight import check_config, compose_checked
    from fledge.pipeline.slurm.submit import plan

    compose(["recipe=tiny", override])  # the schema alone cannot see the registries
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        check_config(compose(["recipe=tiny", override]))
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        compose_checked(["recipe=tiny", override])
    args = argparse.Namespace(nodes=None, gpus_per_node=None, nproc_per_node=None, cpus_per_task=None, array=None,
                              time=None, partition=None, account=None, python=".venv/bin/python", stages=None,
                              max_parallel=None)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        plan("train", args, ["recipe=tiny", override])
