"""Hub upload against a local stub of the Hub API (127.0.0.1): what would be uploaded, retries, refusal."""

import json
import logging

import pytest

from fledge.models.drafter_checkpoint import DrafterCheckpoint
from fledge.pipeline.publish import measured_by_run
from fledge.run_layout import RunLayout
from fledge.serving.card import build_model_card
from fledge.serving.export import write_drafter
from fledge.serving.hub import push_to_hub
from fledge.serving.serving_config import serving_config
from tests.helpers.hub_stub import Stub, commit_files, serve
from tests.helpers.models import CARD_SPEC as SPEC, CARD_TARGET as TARGET, random_state_dict

TOKEN = "hf_secret_token_for_the_stub"


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as constants

    # conftest sets HF_HUB_OFFLINE=1, which huggingface_hub enforces on every request: lift it for the stub only
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with serve() as url:
        yield url


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    config = serving_config(TARGET, SPEC, SPEC.aux_layer_ids, 64)
    write_drafter(run / "export" / "drafter", random_state_dict(config), config,
                  DrafterCheckpoint(SPEC, target={"name_or_path": "org/target-model"}, step=9,
                                    metrics={"acc_0": 0.61}))
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "manifest.json").write_text(json.dumps({"complete": True, "outputs": {
        "sets": {"default": {"al": 2.875, "accept_rate_1": 0.71}, "perturbed": {"al": 2.5, "accept_rate_1": 0.6}}}}))
    (run / "eval" / "al_per_position.png").write_bytes(b"\x89PNG fake")
    (run / "config.yaml").write_text("data:\n  sources:\n  - path: org/chat-data\n    weight: 1.0\n")
    return run


def test_model_card_content(run_dir):
    drafter = run_dir / "export" / "drafter"
    card, plots = build_model_card(drafter, "org/drafter", measured_by_run(RunLayout(run_dir), drafter),
                                   speculative_tokens=4)
    text = str(card)
    assert card.data.base_model == "org/target-model" and card.data.datasets == ["org/chat-data"]
    assert "vllm serve org/target-model --speculative-config" in text
    assert '"method": "eagle3", "model": "org/drafter", "num_speculative_tokens": 4' in text
    # SGLang would read the hf export's aux ids one layer deeper: no SGLang command, the form it reads named
    assert "--speculative-algorithm EAGLE3" not in text and "export.format=sglang" in text
    assert "| default | 0.710 | 2.875 |" in text and "| perturbed |" in text  # measured AL table
    assert "![al_per_position](eval/al_per_position.png)" in text and [p.name for p in plots] == ["al_per_position.png"]
    assert "EAGLE-3.1" in text and "[2, 3, 4]" in text


def test_push_uploads_export_and_card(hub, run_dir, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    drafter = run_dir / "export" / "drafter"
    url = push_to_hub(drafter, "org/drafter", private=True, measured=measured_by_run(RunLayout(run_dir), drafter),
                      target_config=TARGET,
                      endpoint=hub, base_delay=0.0)
    assert url.endswith("/commit/abc")
    create = [json.loads(b) for p, _, b in Stub.calls if p == "/api/repos/create"][0]
    assert create["name"] == "drafter" and create["organization"] == "org" and create["visibility"] == "private"
    assert all(auth == f"Bearer {TOKEN}" for _, auth, _ in Stub.calls)  # token from the environment
    files = commit_files(Stub.calls)
    assert set(files) == {"config.json", "model.safetensors", "fledge_training.json", "README.md",
                          "eval/al_per_position.png"}
    assert files["config.json"] == (drafter / "config.json").read_bytes()
    assert files["model.safetensors"] == (drafter / "model.safetensors").read_bytes()
    assert b"vllm serve org/target-model --speculative-config" in files["README.md"]
    out = capsys.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out.out + out.err  # never printed or logged


def test_push_retries_transient_errors(hub, run_dir):
    Stub.fail_commits = 2
    url = push_to_hub(run_dir / "export" / "drafter", "org/drafter", private=False, target_config=TARGET,
                      endpoint=hub, base_delay=0.0)
    assert url.endswith("/commit/abc")
    create = [json.loads(b) for p, _, b in Stub.calls if p == "/api/repos/create"][0]
    assert create["visibility"] == "public"
    # huggingface_hub may itself retry a 503 once or more; either way the upload ends committed
    assert sum("/commit/" in p for p, _, _ in Stub.calls) >= 3


@pytest.mark.parametrize("private", [True, False])
def test_push_refuses_an_existing_repo_of_the_other_visibility(hub, run_dir, private):
    """create_repo(private=..., exist_ok=True) leaves an existing repo as it is: export.private=true (the default)
    would publish the drafter in a public repo. Refused in one line naming the repo and the fix; nothing committed."""
    Stub.private = not private
    with pytest.raises(ValueError) as e:
        push_to_hub(run_dir / "export" / "drafter", "org/drafter", private=private, target_config=TARGET,
                    endpoint=hub, base_delay=0.0)
    msg = str(e.value)
    assert "\n" not in msg and "org/drafter" in msg and "export.private" in msg
    assert ("is public" if private else "is private") in msg
    assert not any("/commit/" in p for p, _, _ in Stub.calls)


def test_push_refuses_lint_failures(hub, run_dir):
    drafter = run_dir / "export" / "drafter"
    c = json.loads((drafter / "config.json").read_text())
    c["max_position_embeddings"] = 512
    (drafter / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="fails the linter"):
        push_to_hub(drafter, "org/drafter", target_config=TARGET, endpoint=hub, base_delay=0.0)
    assert Stub.calls == []  # nothing was sent


def test_push_under_hf_hub_offline_is_one_line_at_once(run_dir, tmp_path, monkeypatch, capsys):
    """`fledge push` with HF_HUB_OFFLINE=1 (conftest sets it): one line naming HF_HUB_OFFLINE and the fix, exit 2,
    before any request (no 30 s of retries, no traceback), the token nowhere."""
    import time

    from fledge.pipeline.publish import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    with serve() as url:
        start = time.monotonic()
        code = main([str(run_dir / "export" / "drafter"), "org/drafter", "--endpoint", url,
                     "--target", str(tmp_path / "target.json")])
        assert time.monotonic() - start < 5
        assert Stub.calls == []
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "HF_HUB_OFFLINE" in err and "unset" in err, err
    assert "Traceback" not in err and TOKEN not in err


def test_push_serves_the_export_in_its_card_with_the_k_the_run_measured(hub, run_dir, tmp_path):
    """`fledge push` without --k: the card's command carries the eval's eval.draft_tokens (what the eval stage sent
    vLLM), not a default of its own."""
    from fledge.pipeline.publish import main

    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text() + "eval:\n  draft_tokens: 3\n")
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    assert main([str(run_dir / "export" / "drafter"), "org/drafter", "--endpoint", hub,
                 "--target", str(tmp_path / "target.json")]) == 0
    assert b'"model": "org/drafter", "num_speculative_tokens": 3}' in commit_files(Stub.calls)["README.md"]


@pytest.mark.parametrize("status,says", [(401, "token was refused"), (403, "may not write to org/drafter"),
                                         (404, "not found"), (None, "cannot reach the Hub")])
def test_a_hub_failure_is_one_line_naming_the_cause_without_the_token(hub, run_dir, monkeypatch, status, says):
    from fledge.serving.hub import HubError

    endpoint = hub
    if status is None:  # nothing listening: a connection error, retried, then one line
        endpoint = "http://127.0.0.1:9"
    Stub.refuse = status
    with pytest.raises(HubError) as e:
        push_to_hub(run_dir / "export" / "drafter", "org/drafter", target_config=TARGET, endpoint=endpoint,
                    attempts=2, base_delay=0.0)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and TOKEN not in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback under it


@pytest.mark.parametrize("stale", ["export made again", "another drafter"])
def test_the_card_leaves_out_an_eval_of_another_export(run_dir, stale):
    """The card's figures come only from an eval of the export pushed: not after the export was made again
    (the eval's manifest read an older export output), nor from an eval that measured another directory."""
    m = json.loads((run_dir / "eval" / "manifest.json").read_text())
    (run_dir / "export" / "manifest.json").write_text(json.dumps({"complete": True, "output_id": "new"}))
    if stale == "export made again":
        m["read"] = {"export": "old"}
    else:
        (run_dir / "eval" / "report.json").write_text(json.dumps({"drafter": str(run_dir / "elsewhere")}))
    (run_dir / "eval" / "manifest.json").write_text(json.dumps(m))
    drafter = run_dir / "export" / "drafter"
    card, plots = build_model_card(drafter, "org/drafter", measured_by_run(RunLayout(run_dir), drafter))
    assert "2.875" not in str(card) and "No eval-stage results" in str(card) and plots == []
    m["read"] = {"export": "new"}
    (run_dir / "eval" / "manifest.json").write_text(json.dumps(m))
    (run_dir / "eval" / "report.json").write_text(json.dumps({"drafter": str(run_dir / "export" / "drafter")}))
    drafter = run_dir / "export" / "drafter"
    assert "| default | 0.710 | 2.875 |" in str(build_model_card(drafter, "org/drafter",
                                                                   measured_by_run(RunLayout(run_dir), drafter))[0])


def test_the_publish_stage_pushes_after_eval_what_this_eval_measured(hub, tmp_path, monkeypatch):
    """Through the runner, with stand-ins for the stages before it: publish runs after eval; turned on for a
    finished run it pushes; an eval run again (another eval key) makes it push again, with the new figures
    only. Without export.push_to_hub it sends nothing."""
    from dataclasses import replace

    import huggingface_hub.constants as constants

    import fledge.pipeline.runner as runner
    import fledge.pipeline.stages as stages
    from fledge.conf import compose
    from fledge.distributed import init_world

    monkeypatch.setattr(constants, "ENDPOINT", hub)  # what HF_ENDPOINT sets
    (tmp_path / "config.json").write_text(json.dumps(TARGET))  # the target export and publish read
    config = serving_config(TARGET, SPEC, SPEC.aux_layer_ids, 64)

    def fake(stage):
        def run(ctx):
            if stage == "export":
                write_drafter(ctx.stage_dir / "drafter", random_state_dict(config), config,
                              DrafterCheckpoint(SPEC, target={"name_or_path": "org/target-model"}, step=9))
                return {"drafter": str(ctx.stage_dir / "drafter")}
            if stage == "eval":
                measured = ctx.upstream["export"]["outputs"]["drafter"]
                (ctx.stage_dir / "report.json").write_text(json.dumps({"drafter": measured}))
                return {"al_default": 2.0 + ctx.inputs.eval.num_prompts / 8}
            if stage == "train":
                return {"steps": ctx.inputs.train.max_steps, "global_batches_per_epoch": 1,
                        "global_batches_per_step": 1}
            return {}
        return run

    fns = tuple(s if s.name == "publish" else replace(s, run=fake(s.name), check=lambda cfg: None)
                for s in stages.PIPELINE)

    def cfg(*o):
        return compose(["recipe=tiny", f"run.output_root={tmp_path}", f"target.name_or_path={tmp_path}",
                        "export.repo_id=org/drafter", *o])

    world = init_world()
    got = runner.run_stages(cfg(), world, fns)
    assert got["publish"]["outputs"] == {"pushed": False} and Stub.calls == []
    got = runner.run_stages(cfg("export.push_to_hub=true"), world, fns)
    assert got["publish"]["outputs"]["pushed"] and got["eval"]["action"] == "skip"
    card = commit_files(Stub.calls)["README.md"].decode()
    assert "| all | 4.000 |" in card  # eval.num_prompts=16 in recipe=tiny: 2 + 16/8
    Stub.calls.clear()
    runner.run_stages(cfg("export.push_to_hub=true", "eval.num_prompts=4"), world, fns)
    card = commit_files(Stub.calls)["README.md"].decode()
    assert "| all | 2.500 |" in card and "4.000" not in card
    Stub.calls.clear()
    runner.run_stages(cfg("export.push_to_hub=true", "eval.num_prompts=4"), world, fns)
    assert Stub.calls == []  # pushed already: up to date


def test_publishing_needs_hf_token(monkeypatch, tmp_path):
    from fledge.conf import compose
    from fledge.conf.schema import STAGES
    from fledge.pipeline.preflight import check_publish

    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ValueError, match="HF_TOKEN only"):
        check_publish(compose(["recipe=tiny", "export.push_to_hub=true", "export.repo_id=org/x"]).export, STAGES)
    check_publish(compose(["recipe=tiny", "export.push_to_hub=true", "export.repo_id=org/x"]).export, ["train"])
