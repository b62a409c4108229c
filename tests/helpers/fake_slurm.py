"""A fake srun / scontrol / scancel on PATH, for the batch scripts run without Slurm (tests/unit/pipeline/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def submit_module():
    import fledge.pipeline.slurm.submit

    return fledge.pipeline.slurm.submit


FAKE_SRUN = """#!/bin/bash
# fake srun: drop options, run the command once per node as Slurm would on each node
while [[ "$1" == --* ]]; do shift; done
for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i SLURMD_NODENAME=gpu0$((i + 1)) "$@" || exit $?; done
"""
FAKE_SRUN_LONG = """#!/bin/bash
# fake srun that runs until SIGTERM, like a training step at the time limit; real srun would kill the step at
# once on a SIGTERM of its own, so only the fake scancel may deliver it (it reads the pid written here)
trap 'echo term >>"$FAKE_LOG"; exit 143' TERM
echo $$ >"$FAKE_LOG.srun_pid"
touch "$FAKE_LOG"
while :; do sleep 0.05; done
"""
# The first node's NodeAddr differs from its name, as where slurmctld reaches nodes on a management network
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'gpu01\\ngpu02\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=32"; echo "   NodeAddr=10.1.0.$((${3#gpu0}))
  NodeHostName=$3" ;;
  *) echo "$*" >>"$FAKE_LOG.scontrol" ;;
esac
"""
FAKE_SCANCEL = """#!/bin/bash
# fake scancel: --signal=SIG JOB signals the job's steps (the fake srun), never the batch shell
echo "$*" >>"$FAKE_LOG.scancel"
sig=${1#--signal=}
[ -f "$FAKE_LOG.srun_pid" ] && kill -"$sig" "$(cat "$FAKE_LOG.srun_pid")"
"""


def fake_slurm(tmp_path: Path, srun: str, **env: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", srun), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    return {**base, "PATH": f"{bin_dir}:{base['PATH']}", "SLURM_JOB_ID": "999", "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8",
            "FAKE_LOG": str(tmp_path / "fake.log"), **env}


def write_scripts(tmp_path: Path, *args: str) -> Path:
    assert submit_module().main([*args, f"run.output_root={tmp_path / 'out'}", "--python", sys.executable]) == 0
    return tmp_path / "out"
