"""Template perturbation: system-prompt modes, template variables, deterministic per key."""

from fledge.conf.schema import PerturbConfig
from fledge.data.prepare.perturb import chosen, perturb

CONV = {"messages": [{"role": "system", "content": "orig"}, {"role": "user", "content": "q"},
                     {"role": "assistant", "content": "a"}], "source": "s", "index": 0}


def test_modes_and_variables():
    cfg = PerturbConfig(fraction=1.0, system_prompts=["P1", "P2"], template_vars={"enable_x": ["a", "b"]})
    seen = set()
    for i in range(60):
        out = perturb(CONV, cfg, f"s:{i}")
        assert out == perturb(CONV, cfg, f"s:{i}")  # deterministic per key
        assert out["messages"][-2:] == CONV["messages"][1:]  # the turns themselves never change
        sys_msgs = [m for m in out["messages"] if m["role"] == "system"]
        mode = out["perturbation"]["system"]
        seen.add(mode)
        expect = {"none": [""], "default": [], "list": None}[mode]
        if expect is None:
            assert [m["content"] for m in sys_msgs] in (["P1"], ["P2"])
        else:
            assert [m["content"] for m in sys_msgs] == expect
        kw = out["template_kwargs"]
        assert kw["enable_x"] in ("a", "b") and len(kw["date_string"].split()) == 3
    assert seen == {"none", "default", "list"}
    assert CONV["messages"][0]["content"] == "orig"  # input untouched


def test_fraction():
    cfg = PerturbConfig(fraction=0.25)
    n = sum(chosen(cfg, f"s:{i}") for i in range(2000))
    assert 400 < n < 600
    assert not any(chosen(PerturbConfig(fraction=0.0), f"s:{i}") for i in range(100))
