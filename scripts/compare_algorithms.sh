#!/usr/bin/env bash
# EAGLE-3.1 vs P-EAGLE vs DFlash vs DSpark at the same training budget, from one capture, served side by side by vLLM.
#
#   scripts/compare_algorithms.sh ROOT STEPS K [OVERRIDES...]
#   e.g. scripts/compare_algorithms.sh outputs/algos_tiny 300 5 recipe=tiny target.name_or_path=.cache/tiny_target/llama
#        scripts/compare_algorithms.sh outputs/algos_smollm2 1000 5 recipe=smollm2
#
# The eagle31 run does prepare and capture; p_eagle, dflash and dspark link that run's prepare/ and capture/ (read
# only) and train the same STEPS optimizer steps on the same store (DFlash with blocks of K + 1, DSpark with blocks of
# K whose anchor drafts too, so that each drafts K tokens as trained). Each run exports and lints its drafter
# (DSpark's at num_speculative_tokens K); the eval stage is skipped (the engine measures). Then
# scripts/bench_real_target.py serves the exports, plain decoding and vLLM's n-gram lookup on the same
# prompts at batch 1 and 8 (BENCH_ARGS adds to its arguments: the tiny target takes its prompts from the eval
# request of a tiny run with --request, the real one MT-Bench and HumanEval), and prints the table.
# vLLM 0.32 serves DSpark only in its V2 GPU model runner (its CPU build refuses method dspark): DSpark joins the
# served table with DSPARK_SERVE=1, for an engine on a GPU (FLEDGE_ENGINE_PYTHON); otherwise it is trained, exported
# and linted only.
# Environment: NPROC (ranks per run, default 1), DFLASH_ARGS / DSPARK_ARGS (extra overrides for those runs),
# DSPARK_SERVE.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { echo "usage: $0 ROOT STEPS K OVERRIDES... (at least recipe=NAME)" >&2; exit 2; }
root=$1 steps=$2 k=$3; shift 3
mkdir -p "$root" && root=$(cd "$root" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled DS_ACCELERATOR=cpu
nproc=${NPROC:-1}
common=("$@" "run.output_root=$root" "train.max_steps=$steps" "train.eval_every=$steps" "train.save_every=$steps"
        "eval.draft_tokens=$k")
train() {  # NAME STAGES OVERRIDES...
  local name=$1 stages=$2; shift 2
  if [ -f "$root/$name/export/drafter/config.json" ]; then echo "$name: exported already"; return; fi
  local t0=$SECONDS
  .venv/bin/fledge run --nproc-per-node "$nproc" "${common[@]}" "run.name=$name" "run.stages=$stages" "$@" \
    > "$root/$name.log" 2>&1 || { echo "$name failed: see $root/$name.log" >&2; tail -5 "$root/$name.log" >&2; exit 1; }
  echo "$name: $((SECONDS - t0)) s ($stages)" | tee -a "$root/times.txt"
}
train eagle31 "[prepare,capture,train,export]" drafter=eagle31
for name in p_eagle dflash dspark; do
  mkdir -p "$root/$name"
  for stage in prepare capture; do [ -e "$root/$name/$stage" ] || ln -s "$root/eagle31/$stage" "$root/$name/$stage"; done
done
train p_eagle "[train,export]" drafter=p_eagle
# shellcheck disable=SC2086
train dflash "[train,export]" drafter=dflash "drafter.block_size=$((k + 1))" ${DFLASH_ARGS:-}
# shellcheck disable=SC2086
train dspark "[train,export]" drafter=dspark "drafter.block_size=$k" ${DSPARK_ARGS:-}
.venv/bin/fledge lint "$root/dspark/export/drafter" --num-speculative-tokens "$k" | tail -1
algorithms=("eagle31=$root/eagle31/export/drafter" "p_eagle=$root/p_eagle/export/drafter"
            "dflash=$root/dflash/export/drafter")
[ "${DSPARK_SERVE:-0}" = 1 ] && algorithms+=("dspark=$root/dspark/export/drafter")
# shellcheck disable=SC2086
.venv/bin/python scripts/bench_real_target.py --algorithms "${algorithms[@]}" --k "$k" \
  --out "$root/bench.json" ${BENCH_ARGS:-} | tee "$root/table.md"
