"""The engine eval's Fledge side without an engine: config keys, the engine's python, counters -> AL,
the greedy comparison, the failure messages, the report section (tests/engine/ serves real vLLM)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from fledge.conf.schema import Config
from fledge.pipeline.stages import eval_inputs
from fledge.serving.engine import (
    EngineError,
    acceptance,
    check_engine,
    engine_python,
    greedy_differences,
    run_driver,
    speculative_config,
)
from tests.helpers.engine import fake_driver_result
from tests.helpers.paths import REPO

EVAL_DRIVER = REPO / "serving" / "vllm_side" / "eval_driver.py"


def _cfg(**eval_kw) -> Config:
    cfg = Config(recipe="t")
    cfg.target.name_or_path, cfg.target.num_hidden_layers, cfg.target.vocab_size = "t", 8, 100
    cfg.drafter.draft_vocab_size = 50
    for k, v in eval_kw.items():
        setattr(cfg.eval, k, v)
    return cfg


def test_eval_engine_keys_are_validated():
    _cfg(engine="vllm").validate()
    with pytest.raises(ValueError, match=r"eval.engine='trt'"):
        _cfg(engine="trt").validate()
    with pytest.raises(ValueError, match="eval.engine_al_tolerance"):
        _cfg(engine_al_tolerance=0.0).validate()


def test_sglang_is_refused_on_cpu_with_the_fix_and_hf_needs_no_engine():
    with pytest.raises(ValueError, match=r"eval.engine=sglang: .*only on CUDA.*eval.engine=vllm"):
        check_engine("sglang", "cpu")
    assert check_engine("hf", "cpu") is None


def test_missing_engine_python_names_the_setup_script(tmp_path):
    with pytest.raises(ValueError, match=r"eval.engine=vllm: no engine python at .*setup_engine.sh"):
        check_engine("vllm", "cpu", str(tmp_path / "nope" / "python"))
    assert check_engine("vllm", "cpu", sys.executable) == Path(sys.executable)


def test_engine_python_order(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEDGE_ENGINE_PYTHON", "/env/python")
    assert engine_python("/explicit/python") == Path("/explicit/python")
    assert engine_python() == Path("/env/python")
    monkeypatch.delenv("FLEDGE_ENGINE_PYTHON")
    assert engine_python().parts[-4:] == (".engine", "venv", "bin", "python")


def test_acceptance_from_counters():
    a = acceptance({"drafts": 10, "draft_tokens": 50, "accepted": 25, "accepted_per_pos": [9, 7, 5, 3, 1]}, 5)
    assert a["al"] == pytest.approx(3.5) and a["accept_at"] == pytest.approx([.9, .7, .5, .3, .1])
    assert a["draft_acceptance_rate"] == pytest.approx(0.5)
    # AL is 1 + the sum of per-position acceptance (every accepted token sits at some position)
    assert a["al"] == pytest.approx(1 + sum(a["accept_at"]))
    assert math.isnan(acceptance({"drafts": 0, "draft_tokens": 0, "accepted": 0}, 5)["al"])


def test_speculative_configs():
    assert speculative_config("eagle3", 4, Path("d"))["model"] == str(Path("d").resolve())
    ng = speculative_config("ngram", 3, lookup_max=2)
    assert ng == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="medusa"):
        speculative_config("medusa", 3)


def test_greedy_differences_name_prompt_position_and_ties():
    plain = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    spec = [[1, 2, 3, 4], [5, 0, 7], [8, 9, 1]]
    gaps = [[5.0] * 4, [5.0, 1e-4, 5.0], [5.0, 5.0]]
    d = greedy_differences(spec, plain, gaps, tie_gap=1e-3)
    assert [(x["prompt"], x["position"], x["tie"]) for x in d] == [(1, 1, True), (2, 2, False)]
    assert d[0]["spec"] == [0, 7] and d[0]["plain"] == [6, 7]


def test_driver_failures_become_engine_errors(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EngineError, match=r"exited with code 3[\s\S]*no vllm here[\s\S]*setup_engine.sh"):
        run_driver("vllm", fake, {"x": 1}, tmp_path / "w", 60)
    assert json.loads((tmp_path / "w" / "request.json").read_text()) == {"x": 1}
    # A driver that ran but whose engine refused a configuration reports it as data.
    fake.write_text("#!/bin/sh\necho '{\"error\": {\"engine\": \"drafter\", \"type\": \"ValueError\", "
                    "\"message\": \"bad aux ids\", \"traceback\": \"\"}}' > \"$4\"\n")
    with pytest.raises(EngineError, match=r"'drafter' configuration: ValueError: bad aux ids.*fledge lint"):
        run_driver("vllm", fake, {}, tmp_path / "w", 60)


def _section(al_engine: float, diffs=()) -> dict:
    from fledge.evaluation.engine_eval import engine_failures

    s = {"prompts": 2, "in_process_al": 3.0, "in_process_lookup_al": 1.5, "al_gap": al_engine - 3.0,
         "drafter": acceptance({"drafts": 4, "draft_tokens": 8, "accepted": round((al_engine - 1) * 4),
                                "accepted_per_pos": [4, round((al_engine - 2) * 4)]}, 2),
         "lookup": acceptance({"drafts": 4, "draft_tokens": 8, "accepted": 2, "accepted_per_pos": [2, 0]}, 2),
         "tokens_per_s": {"plain": 10.0, "drafter": 20.0, "lookup": 12.0}, "speedup": 2.0, "lookup_speedup": 1.2,
         "greedy_ties": 0, "greedy_differences": list(diffs)}
    return {"engine": "vllm", "version": "0.32.0", "device": "CPU: test", "k": 2, "dtype": "float32",
            "batch_size": 2, "tolerance": 0.15, "sets": {"default": s},
            "failures": engine_failures("default", s, 0.15, Path("exp"), "tgt")}


def test_an_al_gap_beyond_tolerance_fails_with_causes_and_lint():

    assert _section(3.0)["failures"] == []
    (msg,) = _section(1.25)["failures"]
    for part in ("set 'default'", "AL 1.25", "in-process AL 3.00", "eval.engine_al_tolerance=0.15", "aux layer ids",
                 "fc_norm / norm_output", "RoPE", "d2t", "fledge lint exp --target tgt"):
        assert part in msg, part
    diff = {"prompt": 1, "position": 7, "spec": [3], "plain": [4], "top2_gap": 2.0, "tie": False}
    (msg,) = _section(3.0, [diff])["failures"]
    assert "prompt 1" in msg and "generated token 7" in msg


def test_a_collapse_on_every_set_fails_and_a_weak_set_alone_does_not():
    from fledge.evaluation.engine_eval import collapse_failures

    def sets(*als):
        return {f"s{i}": {**_section(al)["sets"]["default"], "in_process_al": al} for i, al in enumerate(als)}

    (msg,) = collapse_failures(sets(1.0, 1.25), 3.0, Path("exp"), "tgt")
    assert "collapsed on every set (best: 's1' 1.25" in msg and "estimate 3.00" in msg and "fledge lint exp" in msg
    assert collapse_failures(sets(1.0, 2.0), 3.0, Path("exp"), "tgt") == []  # a hard set beside a good one
    assert collapse_failures(sets(1.9), 2.7, Path("exp"), "tgt") == []  # half the predicted accepted drafts
    assert collapse_failures(sets(1.0), None, Path("exp"), "tgt") == []  # no estimate (eval without a train stage)


def test_the_exports_held_out_estimate_judges_a_collapse_not_the_targets_own_output():
    """A correct export of a drafter that accepts little of its target's greedy loop is no collapse (measured: the
    tiny MLA target built with AVX2 kernels, AL 1.31 in process and 1.32 in vLLM, training estimate 3.45); an
    export whose held-out estimate, measured through it, fell to under half the trained one is."""
    from fledge.evaluation.engine_eval import collapse_failures, export_estimate

    low = {"default": {**_section(1.25)["sets"]["default"], "in_process_al": 1.25}}
    assert collapse_failures(low, 3.45, Path("exp"), "tgt", export_estimate=3.40) == []
    (msg,) = collapse_failures(low, 3.45, Path("exp"), "tgt", export_estimate=1.9)  # 0.9 < 0.5 * 2.45
    assert "held-out AL estimate 1.90" in msg and "estimate 3.45" in msg and "fledge lint exp --target tgt" in msg
    assert collapse_failures(low, 3.45, Path("exp"), "tgt")  # no held-out measurement: the engine AL judges
    rep = {"ttt_steps": 2, "heldout": {"acc": [0.9, 0.8, 0.7, 0.6], "full_acc": [0.9, 0.7, 0.5, 0.3]}}
    assert export_estimate(rep) == pytest.approx(2.6)  # the trained steps only, as the training estimate
    assert export_estimate({"ttt_steps": 2}) is None


def test_lint_errors_of_the_served_export_fail_with_causes(tmp_path):
    from fledge.evaluation.engine_eval import lint_failures

    assert lint_failures([], tmp_path, "tgt") == []
    (msg,) = lint_failures(["ERROR [aux-ids-trained] config says aux ids [3, 5, 6] but ...\n    fix: ..."],
                           tmp_path, "tgt")
    assert "fails fledge lint with 1 error(s)" in msg and "aux-ids-trained" in msg and "aux layer ids" in msg
    assert f"fledge lint {tmp_path} --target tgt" in msg


def test_report_shows_engine_next_to_in_process_and_the_failure():
    from fledge.evaluation.report import markdown

    report = {"k": 2, "flags": {"fc_norm": True, "norm_output": True}, "drafter": "d", "max_new_tokens": 8,
              "degenerate_threshold": 0.5, "temperature": 0.0, "train_al_estimate": 2.5, "sets": {},
              "engine": _section(1.25)}
    md = markdown(report)
    assert "| default | 2.50 | 3.00 | 1.25 | -1.75 | -1.25 | 1.50 | 1.50 | -0.25 |" in md
    assert "Engine checks failed" in md and "CPU: test" in md


def test_request_names_a_local_target_absolutely_and_a_hub_id_as_is(tmp_path, monkeypatch):
    from fledge.evaluation.engine_eval import build_request

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tgt").mkdir()
    cfg = _cfg(engine="vllm")
    cfg.target.name_or_path = "tgt"
    req = build_request(eval_inputs(cfg), {"default": [[1, 2, 3]]}, tmp_path / "d", [5], 2048, "cpu")
    assert req["target"] == str(tmp_path / "tgt") and req["dtype"] == "float32"
    assert req["max_model_len"] == 3 + cfg.eval.max_new_tokens + cfg.eval.draft_tokens + 16
    assert [e["name"] for e in req["engines"]] == ["plain", "drafter", "lookup"]
    cfg.target.name_or_path = "org/model"
    req = build_request(eval_inputs(cfg), {"default": [[1]]}, tmp_path / "d", [5], 2048, "cuda")
    assert req["target"] == "org/model"


def test_a_sampled_eval_asks_the_drafter_engine_for_a_sampled_pass(tmp_path):
    """eval.temperature > 0: the drafter's vLLM configuration also samples at that temperature (vLLM's
    rejection sampling, the engine's sampled AL); plain and lookup stay greedy only."""
    from fledge.evaluation.engine_eval import build_request

    req = build_request(eval_inputs(_cfg(engine="vllm", temperature=1.0)), {"default": [[1, 2]]}, tmp_path / "d", [5],
                        2048, "cpu")
    assert [e.get("sampled_temperature") for e in req["engines"]] == [None, 1.0, None]
    req = build_request(eval_inputs(_cfg(engine="vllm")), {"default": [[1, 2]]}, tmp_path / "d", [5], 2048, "cpu")
    assert all("sampled_temperature" not in e for e in req["engines"])


def _fake_vllm(monkeypatch):
    """A stand-in ``vllm`` module: every generate call drafts 4 rounds per prompt, accepting 2 tokens per round
    when greedy and 1 when sampling, and answers each prompt with [temperature]."""
    import types

    class Metric:
        def __init__(self, name, value=0, values=None):
            self.name, self.value, self.values = name, value, values

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs, self.c = kwargs, {"drafts": 0, "draft_tokens": 0, "accepted": 0}

        def generate(self, prompts, params, use_tqdm=False):
            per = 2 if params.temperature == 0 else 1
            self.c = {"drafts": self.c["drafts"] + 4 * len(prompts),
                      "draft_tokens": self.c["draft_tokens"] + 8 * len(prompts),
                      "accepted": self.c["accepted"] + 4 * per * len(prompts)}
            out = types.SimpleNamespace(token_ids=[params.temperature], logprobs=None)
            return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

        def get_metrics(self):
            return [Metric(_driver().COUNTERS[k], v) for k, v in self.c.items()]

    class SamplingParams:
        def __init__(self, temperature=1.0, **kwargs):
            self.temperature, self.kwargs = temperature, kwargs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))


def _driver():
    """serving/vllm_side/eval_driver.py, loaded from its file: package data the engine's python runs, never a
    module of Fledge's."""
    spec = importlib.util.spec_from_file_location("eval_driver", EVAL_DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_driver_counts_a_sampled_pass_apart_from_the_greedy_one(monkeypatch):
    _fake_vllm(monkeypatch)
    run_engine = _driver().run_engine
    req = {"target": "t", "max_model_len": 64, "max_new_tokens": 8, "stop_token_ids": [], "seed": 3,
           "sets": {"default": [[1, 2], [3]]}}
    got = run_engine(req, {"name": "drafter", "speculative_config": {"method": "eagle3"}, "sampled_temperature": 1.0})
    s = got["sets"]["default"]
    assert s["outputs"] == [[0.0], [0.0]] and s["counters"]["accepted"] == 16  # greedy: 2 per round
    assert s["sampled"]["counters"] == {"drafts": 8, "draft_tokens": 16, "accepted": 8, "accepted_per_pos": []}
    assert s["sampled"]["temperature"] == 1.0
    assert "sampled" not in run_engine(req, {"name": "drafter"})["sets"]["default"]


def _engine_section(monkeypatch, tmp_path, report: dict, lookup_accepted: int = 1) -> dict:
    """run_engine_eval over a stand-in driver result: 4 drafts per engine, the drafter accepting 4 tokens (2 when
    sampling), vLLM's ngram ``lookup_accepted``."""
    import fledge.evaluation.engine_eval as E

    sets = {"default": [[1]]}
    res = fake_driver_result(sets, lookup_accepted=lookup_accepted, sampled_accepted=2)
    monkeypatch.setattr(E, "run_driver", lambda *a, **k: res)
    monkeypatch.setattr(E, "served_lint_errors", lambda *a, **k: [])
    cfg = _cfg(engine="vllm", temperature=1.0, draft_tokens=2)
    return E.run_engine_eval(eval_inputs(cfg), sets, report, tmp_path / "d", tmp_path, [5], 64, "cpu", Path("py"))


def test_the_engine_section_carries_the_sampled_acceptance(monkeypatch, tmp_path):
    report = {"sets": {"default": {"drafter": {"al": 2.0}, "lookup": {"al": 1.25}}}}
    s = _engine_section(monkeypatch, tmp_path, report)["sets"]["default"]
    assert s["drafter"]["al"] == 2.0 and s["drafter_sampled"]["al"] == 1.5
    assert s["drafter_sampled"]["accept_at"] == [0.5, 0.0]


def test_the_lookup_als_beside_each_other_are_both_per_draft(monkeypatch, tmp_path):
    """The tiny card's table put in-process lookup 1.19 beside vLLM's ngram 1.59 as "counted the same way": in
    process a round whose n-gram found no match counted as AL 1, while vLLM counts only the rounds that drafted. The
    engine section now sets vLLM's figure beside the in-process one per draft (``al_per_draft``), and says so;
    the in-process table labels its own per round."""
    from fledge.evaluation.report import markdown

    report = {"k": 2, "flags": {"fc_norm": True, "norm_output": True}, "drafter": "d", "max_new_tokens": 8,
              "degenerate_threshold": 0.5, "temperature": 0.0, "train_al_estimate": 2.5,
              "sets": {"default": {"drafter": {"al": 2.0}, "lookup": {"al": 1.25, "al_per_draft": 1.5}}}}
    section = _engine_section(monkeypatch, tmp_path, report, lookup_accepted=2)
    s = section["sets"]["default"]
    assert s["in_process_lookup_al"] == 1.5 and s["lookup"]["al"] == 1.5  # vLLM: 1 + 2 accepted / 4 drafts
    md = markdown({**report, "sets": {}, "engine": section})
    assert "| in-process lookup AL (per draft) | engine lookup AL (per draft) |" in md
    assert "both lookup ALs count only the rounds that drafted" in md
    assert "| default | 2.50 | 2.00 | 2.00 | 0.00 | -0.50 | 1.50 | 1.50 | 0.50 |" in md


def test_tokens_per_forward_count_every_round_and_stand_in_the_report(monkeypatch, tmp_path):
    """vLLM's ngram AL is per draft: a round whose n-gram found no match is no draft. Per target forward every
    decode round counts: 3 prompts, 30 tokens (27 from decode rounds), 9 accepted -> 18 rounds, 1.5 a forward,
    where 4 drafts accepting the 9 read as AL 3.25 per draft."""
    import fledge.evaluation.engine_eval as E
    from fledge.evaluation.report import markdown

    assert E.al_per_round(30, 3, 9) == 1.5 and math.isnan(E.al_per_round(3, 3, 0))
    sets = {"default": [[1], [2], [3]]}
    res = fake_driver_result(sets, drafter_accepted=18, lookup_accepted=9)
    for name, tokens in (("drafter", 39), ("lookup", 30)):
        res["engines"][name]["sets"]["default"]["tokens"] = tokens
    monkeypatch.setattr(E, "run_driver", lambda *a, **k: res)
    monkeypatch.setattr(E, "served_lint_errors", lambda *a, **k: [])
    section = E.run_engine_eval(eval_inputs(_cfg(engine="vllm", draft_tokens=2)), sets, {"sets": {}}, tmp_path / "d",
                                tmp_path, [5], 64, "cpu", Path("py"))
    s = section["sets"]["default"]
    assert s["lookup"]["al"] == 1 + 9 / 4 and s["lookup"]["al_per_round"] == 1.5
    assert s["drafter"]["al_per_round"] == 36 / 18
    report = {"k": 2, "flags": {"fc_norm": True, "norm_output": True}, "drafter": "d", "max_new_tokens": 8,
              "degenerate_threshold": 0.5,
              "temperature": 0.0, "in_process": False, "sets": {}, "engine": section}
    assert "| default | 2.00 | 1.50 | 0.50 |" in markdown(report)
