"""The model card serves an export exactly as the eval stage measured it: the speculative_config in the card's vLLM
command and in its Reproduce snippet is, byte for byte, the one the eval stage sends vLLM (with the card's drafter
location), for every algorithm and every EAGLE dialect; and no card prints an SGLang command for a drafter SGLang
would serve otherwise than it was trained (P-EAGLE's parallel drafting, DFlash's block)."""

import json
import re
from types import SimpleNamespace

import pytest

from fledge.conf.schema import DrafterConfig
from fledge.models.algorithms import ALGORITHMS, DrafterSpec
from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.serving import dialects
from fledge.serving.card import Measured, build_model_card
from fledge.serving.export import export_checkpoint, write_drafter
from fledge.serving.serving_config import serving_config
from tests.helpers.models import DFLASH_TARGET as TARGET, random_dflash, random_dspark, random_state_dict
from tests.helpers.mtp import mtp_export

REPO = "org/drafter"
K = 3
IDS = [2, 4, 5]  # the default ids of TARGET's 8 layers: every dialect carries them (the sglang one only these)


def _eagle(tmp_path, fmt: str, parallel: bool):
    spec = DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=64, parallel_drafting=parallel), IDS)
    config = serving_config(TARGET, spec, IDS, 64, fmt=fmt, target_name="org/target")
    out = tmp_path / "out"
    trained = DrafterCheckpoint(spec, target={"name_or_path": "org/target"})
    write_drafter(out, random_state_dict(config), config, trained)
    return out


def _dflash(tmp_path, random=random_dflash):
    d = random(mask_token_id=5)  # DFlash: blocks of 4, DSpark: of 3; k = 3 drafts
    ckpt = DrafterCheckpoint(d.spec, target={"name_or_path": "org/target"}).write(tmp_path / "ckpt", d.state_dict())
    export_checkpoint(ckpt, tmp_path / "out", TARGET)
    return tmp_path / "out"


# Every algorithm, each EAGLE drafter in every dialect: (algorithm, build(tmp_path) -> export dir, parallel or block)
CASES = {**{f"eagle-{fmt}": ("eagle", lambda p, fmt=fmt: _eagle(p, fmt, False), False) for fmt in dialects.names()},
         **{f"p_eagle-{fmt}": ("peagle", lambda p, fmt=fmt: _eagle(p, fmt, True), True) for fmt in dialects.names()},
         "dflash": ("dflash", _dflash, True), "dspark": ("dspark", lambda p: _dflash(p, random_dspark), True),
         "mtp": ("mtp", mtp_export, False)}


def test_every_algorithm_has_a_case():
    assert {algorithm for algorithm, _, _ in CASES.values()} == set(ALGORITHMS.names())


def _eval_request(drafter_dir) -> dict:
    """The request the eval stage builds for the engine (evaluation/engine_eval.py), on a GPU."""
    from fledge.evaluation.engine_eval import build_request

    inputs = SimpleNamespace(  # what build_request reads of the eval stage's inputs (EvalInputs)
        eval=SimpleNamespace(max_new_tokens=16, draft_tokens=K, engine_batch_size=0, temperature=0.0,
                             lookup_max_ngram=3),
        target=SimpleNamespace(name_or_path="org/target", revision=None, trust_remote_code=False, dtype="bfloat16"),
        seed=0)
    return build_request(inputs, {"default": [[1, 2, 3]]}, drafter_dir, [5], 512, "cuda")


def _card(drafter_dir, request: dict) -> str:
    acc = {"drafts": 4, "draft_tokens": 12, "accepted": 6, "al": 2.5, "accept_at": [0.75] * K,
           "draft_acceptance_rate": 0.5}
    engine = {"engine": "vllm", "version": "0.32.0", "device": "H100", "k": K, "dtype": "bfloat16", "sets": {
        "default": {"prompts": 1, "drafter": acc, "lookup": acc, "in_process_al": 2.5,
                    "tokens_per_s": {"plain": 1.0, "drafter": 2.0}}}}
    measured = Measured(outputs={"sets": {"default": {"al": 2.5}}}, engine=engine, engine_request=request)
    return str(build_model_card(drafter_dir, REPO, measured, speculative_tokens=K)[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_card_serves_the_export_with_the_eval_stages_speculative_config(tmp_path, case):
    algorithm, build, parallel = CASES[case]
    out = build(tmp_path)
    request = _eval_request(out)
    sent = next(e["speculative_config"] for e in request["engines"] if e["name"] == "drafter")
    assert sent["model"] == str(out.resolve()) and sent["num_speculative_tokens"] == K
    assert sent["method"] == ALGORITHMS.get(algorithm).vllm_method
    assert sent.get("parallel_drafting", False) == (algorithm == "peagle")  # vLLM sets dflash's itself
    want = {**sent, "model": REPO}
    text = _card(out, request)

    commands = re.findall(r"vllm serve \S+ --speculative-config '([^']*)'", text)
    snippets = re.findall(r"speculative_config=(\{.*?\})\)\n", text)
    assert len(commands) == 1 and len(snippets) == 1, text
    for got in (commands[0], snippets[0]):
        assert json.loads(got) == want
        assert got == json.dumps(want)  # byte for byte

    if parallel:  # SGLang would run it as a chain drafter (P-EAGLE) or not at all (DFlash): no command, a reason
        assert "sglang.launch_server" not in text
        assert "parallel drafting" in text or "SGLang: not given" in text


def test_a_p_eagle_speculators_export_is_served_in_parallel_by_vllm_serve_dir_alone(tmp_path):
    """`vllm serve DIR` builds its speculative_config from the speculators config alone (vLLM 0.32's
    SpeculatorsConfig.build_vllm_speculative_config): parallel_drafting only from speculators_model_type peagle."""
    out = _eagle(tmp_path, "speculators", True)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 0
    assert json.loads((_eagle(tmp_path / "chain", "speculators", False) / "config.json").read_text())[
        "speculators_model_type"] == "eagle3"


def test_the_linter_refuses_a_p_eagle_speculators_config_vllm_would_serve_as_a_chain(tmp_path):
    from fledge.serving.lint import format_findings, has_errors, lint_drafter

    out = _eagle(tmp_path, "speculators", True)
    findings = lint_drafter(out, TARGET)
    assert not has_errors(findings), format_findings(findings)
    config = json.loads((out / "config.json").read_text())
    config["speculators_model_type"] = "eagle3"  # as Fledge wrote a P-EAGLE speculators export before
    (out / "config.json").write_text(json.dumps(config))
    errors = [f for f in lint_drafter(out, TARGET) if f.level == "error"]
    assert any(f.code == "speculators-model-type" and "chain drafter" in f.message for f in errors), errors
    config["speculators_model_type"] = "peagle"
    del config["mask_token_id"]  # the top-level key vLLM's peagle reader takes
    (out / "config.json").write_text(json.dumps(config))
    assert "speculators-mask-token" in {f.code for f in lint_drafter(out, TARGET) if f.level == "error"}


def test_a_dflash_export_is_never_served_more_drafts_than_its_block_trained(tmp_path):
    from fledge.serving.engine import speculative_config

    out = _dflash(tmp_path)  # blocks of 4
    text = str(build_model_card(out, REPO, speculative_tokens=9)[0])
    assert json.loads(re.findall(r"--speculative-config '([^']*)'", text)[0])["num_speculative_tokens"] == 3
    assert speculative_config("eagle3", 9, out)["num_speculative_tokens"] == 3


def test_the_reproduce_snippet_loads_the_target_as_the_eval_did(tmp_path):
    """The eval's driver loads the target at its revision, with its own code, and on a CPU with the attention
    backend its family needs (serving/vllm_side/eval_driver.py): the snippet says the same, or it reproduces
    another model's acceptance (another revision) without a word."""
    import ast

    out = _eagle(tmp_path, "hf", False)
    request = {**_eval_request(out), "revision": "0123abc", "trust_remote_code": True, "attention_backend": "CPU_MLA"}
    snippet = _card(out, request).split("```python\n")[1].split("```")[0]
    call = next(n for n in ast.walk(ast.parse(snippet))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LLM")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert {key: kwargs.get(key) for key in ("model", "revision", "trust_remote_code", "attention_backend")} == {
        "model": "org/target", "revision": "0123abc", "trust_remote_code": True, "attention_backend": "CPU_MLA"}
    plain = _card(out, _eval_request(out)).split("```python\n")[1].split("```")[0]
    assert "revision=" not in plain and "trust_remote_code=" not in plain  # only what the eval set


@pytest.mark.parametrize("flags", [{"fc_norm": True, "norm_output": True}, {"fc_norm": False, "norm_output": False}])
def test_an_sglang_command_for_an_eagle_3_1_drafter_says_which_sglang_reads_its_flags(tmp_path, flags):
    """SGLang's llama_eagle3 before EAGLE-3.1 support skips fc_norm.* and feeds back the un-normed state: the card
    printing its command for a 3.1 drafter says so."""
    spec = DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=64, **flags), IDS)
    config = serving_config(TARGET, spec, IDS, 64, fmt="sglang")
    write_drafter(tmp_path / "out", random_state_dict(config), config, DrafterCheckpoint(spec))
    text = str(build_model_card(tmp_path / "out", REPO)[0])
    assert "sglang.launch_server" in text
    assert ("loads this drafter as EAGLE-3 without a word" in text) == flags["fc_norm"]


def test_the_linter_reports_a_config_without_the_layer_sizes_instead_of_failing(tmp_path):
    """A speculators config whose type was removed reads as the hf dialect, without the layer's sizes (nested in
    transformer_layer_config): one finding, not a KeyError out of `fledge lint` or `fledge push`."""
    from fledge.serving.lint import lint_drafter

    out = _eagle(tmp_path, "speculators", True)
    config = json.loads((out / "config.json").read_text())
    del config["speculators_model_type"]
    (out / "config.json").write_text(json.dumps(config))
    findings = lint_drafter(out, TARGET)
    assert [(f.level, f.code) for f in findings] == [("error", "config-sizes")]
    assert "hidden_size" in findings[0].message
