"""`vllm serve DIR` on a speculators-format export builds its speculative_config from config.json alone (vLLM 0.32's
``maybe_override_with_speculators``, run in .engine/venv, nothing served): a P-EAGLE export must come out with
``parallel_drafting`` (else vLLM runs it as a chain drafter without a word), every one with the method and the
drafter flags the eval stage serves it with (serving/serving_config.py's ``vllm_speculative_config``)."""

from __future__ import annotations

import json
import subprocess

from fledge.conf.schema import DrafterConfig
from fledge.engine_process import engine_python
from fledge.models.algorithms import DrafterSpec
from fledge.serving.serving_config import serving_config, vllm_speculative_config
from tests.helpers.engine import engine_marks
from tests.helpers.models import DFLASH_TARGET as TARGET
from tests.helpers.suites import FULL_ONLY

pytestmark = engine_marks()

# Runs in the engine's python: a drafter directory per line on stdin -> the speculative_config `vllm serve DIR`
# builds, and the drafter config vLLM makes of it.
READ = """
import json, sys
from vllm.transformers_utils.config import maybe_override_with_speculators
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
for line in sys.stdin:
    d = line.strip()
    target, _, spec = maybe_override_with_speculators(model=d, tokenizer=None, trust_remote_code=False)
    cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(json.load(open(d + "/config.json")))
    print(json.dumps({"target": target, "spec": spec, "fc_norm": cfg.get("fc_norm"),
                      "norm_output": cfg.get("norm_output"), "mask_token_id": cfg.get("mask_token_id")}))
"""


@FULL_ONLY  # CI's 30 minutes (70 s there); its CI twins: the derived config and the peagle type against the card
# and the linter (tests/unit/serving/test_served_as_measured.py), and P-EAGLE served with parallel drafting at its
# in-process acceptance (tests/engine/test_vllm_serving.py)
def test_vllm_serve_dir_serves_a_speculators_export_as_the_eval_stage_does(tmp_path):
    dirs = {}
    for parallel in (False, True):
        spec = DrafterSpec.from_target_config(TARGET, DrafterConfig(draft_vocab_size=64, parallel_drafting=parallel,
                                                                    fc_norm=True, norm_output=True), [2, 4, 5])
        d = tmp_path / ("p_eagle" if parallel else "eagle")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(serving_config(TARGET, spec, [2, 4, 5], 64, fmt="speculators",
                                                                 target_name="org/target", speculative_tokens=3)))
        dirs[parallel] = d
    res = subprocess.run([str(engine_python()), "-c", READ], input="\n".join(str(d) for d in dirs.values()),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    for (parallel, d), g in zip(dirs.items(), got):
        config = json.loads((d / "config.json").read_text())
        assert g["target"] == "org/target" and g["spec"] == vllm_speculative_config(config, str(d), 3), g
        assert g["fc_norm"] is True and g["norm_output"] is True, g  # EAGLE-3.1's flags reach the model
        assert g["mask_token_id"] == (0 if parallel else None), g
    assert len(got) == 2
