"""The model card's engine section: the AL table vLLM measured and the call that reproduces it."""

import json

from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.pipeline.publish import measured_by_run
from fledge.run_layout import RunLayout
from fledge.serving.card import build_model_card
from fledge.serving.export import write_drafter
from fledge.serving.serving_config import serving_config
from tests.helpers.models import CARD_SPEC as SPEC, CARD_TARGET as TARGET, random_state_dict


def _measured(run):
    """What the run measured of its export, as the publish stage hands it to the card (pipeline/publish.py)."""
    return measured_by_run(RunLayout(run), run / "export" / "drafter")


def _acc(al, per_pos, drafts=10):
    return {"drafts": drafts, "draft_tokens": drafts * 2, "accepted": round((al - 1) * drafts), "al": al,
            "accept_at": per_pos, "draft_acceptance_rate": 0.5}


def _run(tmp_path, engine: bool):
    run = tmp_path / "run"
    config = serving_config(TARGET, SPEC, SPEC.aux_layer_ids, 64)
    write_drafter(run / "export" / "drafter", random_state_dict(config), config,
                  DrafterCheckpoint(SPEC, target={"name_or_path": "org/target-model"}, step=9))
    (run / "eval" / "engine").mkdir(parents=True)
    report = {"sets": {}}
    if engine:
        report["engine"] = {"engine": "vllm", "version": "0.32.0", "device": "CPU: Xeon, 2 cores", "k": 2,
                            "dtype": "float32", "sets": {"default": {
                                "prompts": 8, "drafter": _acc(2.25, [0.75, 0.5]), "lookup": _acc(1.5, [0.5, 0.0]),
                                "in_process_al": 2.3, "tokens_per_s": {"plain": 40.0, "drafter": 81.5}}}}
        (run / "eval" / "engine" / "request.json").write_text(json.dumps({
            "target": "org/target-model", "dtype": "float32", "max_model_len": 600, "seed": 0, "max_new_tokens": 32,
            "stop_token_ids": [5], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "sets": {"default": [[1, 2]]}}))
    (run / "eval" / "report.json").write_text(json.dumps(report))
    # a complete eval of this export: the card takes figures from nothing else (pipeline/publish.py)
    (run / "eval" / "manifest.json").write_text(json.dumps({"complete": True, "outputs": {
        "sets": {"default": {"al": 2.3}}}}))
    return run


def test_card_carries_the_engine_table_and_the_reproducing_call(tmp_path):
    run = _run(tmp_path, engine=True)
    text = str(build_model_card(run / "export" / "drafter", "org/drafter", _measured(run), speculative_tokens=2)[0])
    assert "## Measured by the serving engine" in text and "**vllm 0.32.0** on CPU: Xeon, 2 cores" in text
    assert "| default | 8 | 2.25 | 2.30 | 1.50 | 0.75 0.50 | 40.0 -> 81.5 |" in text
    assert ("LLM(model='org/target-model', dtype='float32', max_model_len=600, seed=0" in text
            and '"model": "org/drafter", "num_speculative_tokens": 2' in text
            and "max_tokens=32, stop_token_ids=[5]" in text and "VLLM_CPU_KVCACHE_SPACE" in text)
    assert "SGLang" in text and "**not measured**" in text
    snippet = text.split("```python\n")[1].split("```")[0]
    compile(snippet, "card", "exec")  # the reproducing call is valid Python


def test_card_without_an_engine_run_has_no_engine_section(tmp_path):
    run = _run(tmp_path, engine=False)
    text = str(build_model_card(run / "export" / "drafter", "org/drafter", _measured(run))[0])
    assert "Measured by the serving engine" not in text and "not measured" not in text


def test_card_of_an_engine_only_eval_says_the_engine_alone_measured_it(tmp_path):
    """eval.in_process=false: no in-process AL beside the engine's, and the card does not claim one."""
    run = _run(tmp_path, engine=True)
    report = json.loads((run / "eval" / "report.json").read_text())
    report["engine"]["sets"]["default"]["in_process_al"] = None
    (run / "eval" / "report.json").write_text(json.dumps(report))
    text = str(build_model_card(run / "export" / "drafter", "org/drafter", _measured(run), speculative_tokens=2)[0])
    assert "the prompts measured by the engine alone (no in-process AL)" in text
    assert "next to Fledge's in-process measurement" not in text and "| default | 8 | 2.25 | n/a | 1.50 |" in text
