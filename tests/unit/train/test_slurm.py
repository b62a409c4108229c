"""Slurm support without Slurm: node lists, the rendezvous from SLURM_* sets, the submit helper, and the
batch scripts executed under a fake srun/scontrol."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fledge.train.slurm import serve
from fledge.train.slurm.launch import (
    PORT_BASE,
    PORT_SPAN,
    build_command,
    capture_slice_overrides,
    expand_nodelist,
    from_slurm_env,
    nproc_per_node,
    parse_args,
    worker_env,
)
from tests.helpers.paths import REPO

SLURM_DIR = REPO / "train" / "slurm"


def _submit_module():
    import fledge.train.slurm.submit

    return fledge.train.slurm.submit


# ---- node lists -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,hosts", [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("node-[001-003]", ["node-001", "node-002", "node-003"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu-a100-[3,5]-ib,login.cluster.org", ["gpu-a100-3-ib", "gpu-a100-5-ib", "login.cluster.org"]),
    ("single", ["single"]),
])
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-04", "gpu01]", "gpu[04-01]", "gpu[a-b]", "a,,b", ""])
def test_expand_nodelist_rejects_malformed(spec):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(spec)


# ---- rendezvous from real variable sets -------------------------------------------------------------

# What `srun --ntasks-per-node=1` shows on the 2nd node of `sbatch --nodes=2 --gpus-per-node=h100:8`,
# after one requeue (trimmed to the variables that matter plus some that must not confuse the parser).
TWO_NODE_STEP = {
    "SLURM_JOB_ID": "4711023", "SLURM_JOBID": "4711023", "SLURM_JOB_NAME": "fledge-train-llama3",
    "SLURM_JOB_NODELIST": "gpu[17-18]", "SLURM_NODELIST": "gpu[17-18]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "gpu[17-18]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "gpu18", "SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "h100:8",
    "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "SLURM_RESTART_COUNT": "1", "SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": "/home/u/fledge",
}


def test_two_node_step():
    r = from_slurm_env(TWO_NODE_STEP)
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.world_size) == (2, 1, 8, 16)
    assert r.master_addr == "gpu17" and r.job_id == "4711023" and r.restart_count == 1
    assert r.master_port == PORT_BASE + 4711023 % PORT_SPAN
    assert r.torchrun_args() == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
                                 f"--rdzv_endpoint=gpu17:{r.master_port}", "--rdzv_id=fledge-4711023"]
    assert "--node_rank=1" in r.torchrun_args("static")


def test_compressed_list_and_gres_without_gpus_on_node():
    env = {"SLURM_JOB_ID": "88", "SLURM_JOB_NODELIST": "gpu[01-04,07]", "SLURM_NNODES": "5",
           "SLURM_NODEID": "4", "SLURM_GPUS_PER_NODE": "gpu:a100:4(IDX:0-3)", "SLURM_NTASKS_PER_NODE": "1"}
    r = from_slurm_env(env)
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.master_addr) == (5, 4, 4, "gpu01")


def test_node_rank_from_hostname_and_master_from_scontrol():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "a[1-2],b3", "SLURM_NNODES": "3",
           "SLURMD_NODENAME": "b3", "SLURM_NODEID": "0", "MASTER_ADDR": "a1-ib0", "MASTER_PORT": "29999"}
    r = from_slurm_env(env)
    assert (r.node_rank, r.master_addr, r.master_port, r.nproc_per_node) == (2, "a1-ib0", 29999, 1)


def test_ports_differ_between_jobs_sharing_a_node():
    ports = {from_slurm_env({**TWO_NODE_STEP, "SLURM_JOB_ID": str(j)}).master_port for j in range(100, 110)}
    assert len(ports) == 10 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


@pytest.mark.parametrize("change,match", [
    ({"SLURM_STEP_NUM_NODES": "3"}, "expands to 2 hosts"),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, "ONE srun task per node"),
    ({"SLURM_JOB_ID": ""}, "not inside a Slurm job"),
    ({"SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": "7"}, "outside the 2 nodes"),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_NODE": "h100:many"}, "cannot read a GPU count"),
])
def test_inconsistent_variables_are_errors(change, match):
    with pytest.raises(ValueError, match=match):
        from_slurm_env({**TWO_NODE_STEP, **change, "SLURM_JOBID": change.get("SLURM_JOB_ID", "4711023")})


def test_nproc_fallbacks():
    assert nproc_per_node({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert nproc_per_node({"SLURM_GPUS_PER_NODE": "a100:2,v100:2"}) == 4
    assert nproc_per_node({}) == 1
    assert nproc_per_node({"SLURM_GPUS_ON_NODE": "8"}, override=2) == 2
    with pytest.raises(ValueError, match="must be >= 1"):
        nproc_per_node({}, override=0)


def test_workers_share_the_tasks_cpus():
    """OpenMP threads per worker: the task's CPUs over its workers (a 2-CPU node with 2 ranks: 1, like torchrun's
    own default off Slurm), unless the user set OMP_NUM_THREADS; outside Slurm torchrun's default stands."""
    assert worker_env({"SLURM_CPUS_PER_TASK": "64"}, 8) == {"OMP_NUM_THREADS": "8"}
    assert worker_env({"SLURM_CPUS_PER_TASK": "2"}, 2) == {"OMP_NUM_THREADS": "1"}
    assert worker_env({"SLURM_CPUS_PER_TASK": "3"}, 4) == {"OMP_NUM_THREADS": "1"}
    assert worker_env({"SLURM_CPUS_PER_TASK": "64", "OMP_NUM_THREADS": "4"}, 8) == {}
    assert worker_env({}, 2) == {}


def test_capture_slices_come_from_the_array_task_id():
    env = {**TWO_NODE_STEP, "SLURM_ARRAY_JOB_ID": "500", "SLURM_ARRAY_TASK_ID": "3"}
    assert capture_slice_overrides(env, 8) == ["capture.slice_index=3", "capture.num_slices=8"]
    with pytest.raises(ValueError, match="outside 0..1"):
        capture_slice_overrides(env, 2)
    with pytest.raises(ValueError, match="needs an array job"):
        capture_slice_overrides(TWO_NODE_STEP, 8)


def test_build_command_under_slurm_and_on_a_workstation():
    argv = ["--capture-slices", "4", "train/main.py", "recipe=llama3", "run.stages=[capture]"]
    cmd = build_command(parse_args(argv), {**TWO_NODE_STEP, "SLURM_ARRAY_TASK_ID": "2"}, python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    i = cmd.index("train/main.py")
    assert "--rdzv_endpoint=gpu17:" + str(PORT_BASE + 4711023 % PORT_SPAN) in cmd[:i]
    assert cmd[i + 1:] == ["recipe=llama3", "run.stages=[capture]", "capture.slice_index=2", "capture.num_slices=4"]
    local = build_command(parse_args(["--nproc-per-node", "2", "train/main.py", "recipe=tiny"]), {}, python="py")
    assert local == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train/main.py",
                     "recipe=tiny"]
    module = build_command(parse_args(["--nproc-per-node", "2", "fledge.train.main", "recipe=tiny"]), {}, python="py")
    assert module[-4:] == ["--nproc_per_node=2", "-m", "fledge.train.main", "recipe=tiny"]  # works from a wheel


# ---- batch scripts and the submit helper ------------------------------------------------------------

def test_the_three_scripts_share_one_body():
    bodies = {p.name: p.read_text().split("# ---- end knobs ----")[1] for p in SLURM_DIR.glob("*.sbatch")}
    assert set(bodies) == {"train.sbatch", "capture.sbatch", "capture_array.sbatch"}
    assert len(set(bodies.values())) == 1, "edit train.sbatch's body and copy it to the other two"


def test_dry_run_prints_filled_scripts_and_writes_nothing(tmp_path, capsys):
    submit = _submit_module()
    rc = submit.main(["pipeline", "recipe=llama3", f"run.output_root={tmp_path}", "--array", "4", "--nodes", "2",
                      "--partition", "h100", "--dry-run", "train.epochs=2", "logging.wandb_tags=[a b,c]"])
    out = capsys.readouterr().out
    assert rc == 0 and not any(tmp_path.iterdir())
    assert out.count("#!/bin/bash") == 3  # prepare, capture array, train
    assert "#SBATCH --array=0-3" in out and "#SBATCH --partition=h100" in out and "##SBATCH --account=" in out
    assert "#SBATCH --nodes=2" in out and "LAUNCH_ARGS=(--capture-slices 4)" in out
    assert "OVERRIDES=(train.epochs=2 'logging.wandb_tags=[a b,c]' capture.num_slices=4)" in out
    assert f"--dependency=afterok:${{capture_array%%;*}} {tmp_path}/llama3/slurm/train.sbatch" in out


def test_bad_override_fails_at_submit_time(capsys):
    submit = _submit_module()
    assert submit.main(["train", "recipe=llama3", "train.no_such_key=1", "--dry-run"]) == 2
    assert "no_such_key" in capsys.readouterr().err


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


def _fake_slurm(tmp_path: Path, srun: str, **env: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", srun), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    return {**base, "PATH": f"{bin_dir}:{base['PATH']}", "SLURM_JOB_ID": "999", "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8",
            "FAKE_LOG": str(tmp_path / "fake.log"), **env}


def _write_scripts(tmp_path: Path, *args: str) -> Path:
    assert _submit_module().main([*args, f"run.output_root={tmp_path / 'out'}", "--python", sys.executable]) == 0
    return tmp_path / "out"


def test_filled_train_script_runs_launch_on_every_node(tmp_path, capsys):
    out = _write_scripts(tmp_path, "train", "recipe=llama3", "--nodes", "2", "logging.wandb_tags=[a b,c]")
    env = _fake_slurm(tmp_path, FAKE_SRUN, FLEDGE_LAUNCH_DRY_RUN="1", SLURM_CPUS_PER_TASK="64")
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(["bash", str(out / "llama3/slurm/train.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line) for line in res.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(cmds) == 2  # one torchrun per node, identical rendezvous
    assert cmds[0] == cmds[1]
    assert cmds[0][0] == "OMP_NUM_THREADS=8"  # 64 CPUs over 8 workers
    assert "--nnodes=2" in cmds[0] and "--nproc_per_node=8" in cmds[0]
    assert f"--rdzv_endpoint=10.1.0.1:{PORT_BASE + 999}" in cmds[0]  # gpu01's NodeAddr
    assert cmds[0][cmds[0].index("fledge.train.main") - 1:cmds[0].index("fledge.train.main")] == ["-m"]
    assert cmds[0][cmds[0].index("fledge.train.main") + 1:] == [
        "recipe=llama3", "run.name=llama3", f"run.output_root={out}",
        "run.stages=[prepare,capture,train,export,eval,publish]",
        "logging.wandb_tags=[a b,c]"]
    start, end = [line.split("\t") for line in (out / "llama3/slurm/jobs.tsv").read_text().splitlines()]
    assert start[1:5] == ["999", "-", "0", "gpu[01-02]"] and start[6] == "start"
    assert end[1:4] == ["999", "-", "0"] and end[6] == "exit 0"
    assert (out / "llama3/logs").is_dir()


@pytest.mark.parametrize("restarts,requeued", [("0", True), ("5", False)])
def test_time_limit_signal_stops_the_step_and_requeues(tmp_path, restarts, requeued):
    out = _write_scripts(tmp_path, "train", "recipe=tiny")
    env = _fake_slurm(tmp_path, FAKE_SRUN_LONG, SLURM_RESTART_COUNT=restarts)
    proc = subprocess.Popen(["bash", str(out / "tiny/slurm/train.sbatch")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "fake.log"
    deadline = time.time() + 30
    while not log.exists() and time.time() < deadline:
        time.sleep(0.05)
    if not log.exists():
        proc.kill()
        pytest.fail(f"the fake srun never started:\n{proc.communicate()[0]}")
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 delivers to the batch shell
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, stdout
    assert log.read_text().strip() == "term"
    assert (tmp_path / "fake.log.scancel").read_text().strip() == "--signal=TERM 999"  # the step, not srun
    scontrol = tmp_path / "fake.log.scontrol"
    assert (scontrol.exists() and scontrol.read_text().strip() == "requeue 999") == requeued, stdout
    end = (out / "tiny/slurm/jobs.tsv").read_text().splitlines()[-1].split("\t")
    assert end[6] == ("exit 143 after USR1, requeued" if requeued else "exit 143 after USR1, MAX_REQUEUES=5 reached")


def test_sigterm_from_slurm_lets_the_step_finish_and_is_recorded(tmp_path):
    """A requeue, a preemption or scancel: Slurm sends SIGTERM to the batch shell and to the step; the shell
    must outlive it to say how the step ended (the ranks checkpoint meanwhile), and must not requeue."""
    out = _write_scripts(tmp_path, "train", "recipe=tiny")
    env = _fake_slurm(tmp_path, FAKE_SRUN_LONG)
    proc = subprocess.Popen(["bash", str(out / "tiny/slurm/train.sbatch")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "fake.log"
    deadline = time.time() + 30
    while not log.exists() and time.time() < deadline:
        time.sleep(0.05)
    srun_pid = int((tmp_path / "fake.log.srun_pid").read_text())
    try:
        proc.send_signal(signal.SIGTERM)  # the batch shell's share of Slurm's SIGTERM
        time.sleep(0.5)
        assert proc.poll() is None, "the batch shell died before its step"
        os.kill(srun_pid, signal.SIGTERM)  # the step's share
        stdout, _ = proc.communicate(timeout=30)
    finally:
        for pid in (srun_pid, proc.pid):  # the fake step holds the output pipe open: never leave it behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 143, stdout
    assert not (tmp_path / "fake.log.scontrol").exists(), stdout  # Slurm requeues (or not) by itself
    end = (out / "tiny/slurm/jobs.tsv").read_text().splitlines()[-1].split("\t")
    assert end[6] == "exit 143 after SIGTERM", end
    assert "SIGTERM from Slurm" in stdout


# ---- a served target: the heterogeneous job --------------------------------------------------------------

ONLINE = ["capture.mode=online", "capture.engine=vllm"]


def _dry(capsys, *args: str) -> tuple[int, str, str]:
    rc = _submit_module().main([*args, "--dry-run"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _knob(text: str, name: str) -> list[str]:
    """A bash-array knob of a filled script, as bash reads it."""
    line = next(x for x in text.splitlines() if x.startswith(f"{name}=("))
    return shlex.split(line[len(name) + 2:-1])


def test_kimi_k2_online_is_one_het_job_of_16_training_and_16_serving_gpus(capsys, tmp_path):
    rc, out, _ = _dry(capsys, "pipeline", "recipe=kimi_k2", *ONLINE, f"run.output_root={tmp_path}",
                      "--partition", "h200")
    assert rc == 0 and out.count("#!/bin/bash") == 1  # pipeline: prepare runs inside the het job
    header = [x for x in out.splitlines() if x.startswith("#SBATCH")]
    split = header.index("#SBATCH hetjob")
    trainers, engines = header[:split], header[split + 1:]
    assert {"#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=h200"} <= set(trainers)
    assert engines == ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                       "#SBATCH --cpus-per-task=64", "#SBATCH --time=48:00:00", "#SBATCH --partition=h200"]
    overrides = _knob(out, "OVERRIDES")
    assert {"capture.ranks_per_engine=8", "capture.tensor_parallel_size=8"} <= set(overrides)  # the recipe's
    launcher = _submit_module().compose(["recipe=kimi_k2", *overrides]).capture.engine_launcher
    assert launcher == ["srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--exact", "--gpus-per-node=8",
                        "--cpus-per-task=64"]
    assert _knob(out, "REGENERATE") == []
    assert not any(tmp_path.iterdir())


def test_the_layout_sizes_engines_from_ranks_per_engine_and_tp(capsys, tmp_path):
    """16 trainer ranks, 2 per engine, TP 2: 8 engines of 2 GPUs = 4 per 8-GPU node, 2 nodes, 16 CPUs each."""
    rc, out, _ = _dry(capsys, "train", "recipe=llama3", *ONLINE, "capture.ranks_per_engine=2",
                      "capture.tensor_parallel_size=2", "--nodes", "2", "--engine-nodes", "2",
                      f"run.output_root={tmp_path}")
    assert rc == 0
    launcher = _submit_module().compose(["recipe=llama3", *_knob(out, "OVERRIDES")]).capture.engine_launcher
    assert launcher[-2:] == ["--gpus-per-node=2", "--cpus-per-task=16"]
    # CPU engine nodes (as the test cluster): no GPUs asked for, the engines share the node's CPUs
    rc, out, _ = _dry(capsys, "train", "recipe=tiny", *ONLINE, "--engine-nodes", "1", "--engine-cpus-per-task", "4",
                      f"run.output_root={tmp_path}")
    launcher = _submit_module().compose(["recipe=tiny", *_knob(out, "OVERRIDES")]).capture.engine_launcher
    assert rc == 0 and launcher == ["srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--exact", "--cpus-per-task=2"]
    assert "#SBATCH --gpus-per-node" not in out.split("#SBATCH hetjob")[1].split("# ---- knobs")[0]


def test_no_engine_nodes_is_one_plain_job(capsys, tmp_path):
    rc, out, _ = _dry(capsys, "pipeline", "recipe=kimi_k2", *ONLINE, "--engine-nodes", "0",
                      f"run.output_root={tmp_path}")
    assert rc == 0 and "\n#SBATCH hetjob\n" not in out and out.count("#!/bin/bash") == 2  # capture, then train
    assert "engine_launcher" not in "".join(x for x in out.splitlines() if x.startswith("OVERRIDES="))


def test_a_launcher_on_the_command_line_is_kept(capsys, tmp_path):
    mine = "capture.engine_launcher=[srun,'--het-group=1','--nodes=1','--overlap']"
    rc, out, err = _dry(capsys, "train", "recipe=kimi_k2", *ONLINE, mine, f"run.output_root={tmp_path}")
    assert rc == 0 and "keeping capture.engine_launcher" in err
    assert [o for o in _knob(out, "OVERRIDES") if o.startswith("capture.engine_launcher")] == [mine]


@pytest.mark.parametrize("args,match", [
    (["train", "recipe=llama3", "--engine-nodes", "1"], "add capture.mode=online capture.engine=vllm"),
    (["train", "recipe=llama3", "capture.mode=online", "--engine-nodes", "1"], "add capture.mode=online"),
    (["train", "recipe=llama3", *ONLINE, "capture.tensor_parallel_size=8", "--nodes", "2", "--engine-nodes", "1"],
     "16 engines .* need 16 engine nodes of 8 GPUs; --engine-nodes 1 holds 1"),
    (["train", "recipe=llama3", *ONLINE, "capture.tensor_parallel_size=16", "--engine-nodes", "4"],
     "do not fit on one engine node of 8 GPUs"),
    (["train", "recipe=llama3", *ONLINE, "capture.ranks_per_engine=3", "--engine-nodes", "1"],
     "8 trainer ranks do not split"),
    (["train", "recipe=tiny", *ONLINE, "--engine-nodes", "1", "--engine-cpus-per-task", "1"],
     "2 engines per node on 1 CPUs"),
    (["capture", "recipe=kimi_k2", *ONLINE], "submit train or pipeline"),
    (["train", "recipe=kimi_k2", *ONLINE, "--engine-nodes", "-1"], "a node count"),
    (["pipeline", "recipe=kimi_k2", *ONLINE, "--array", "4"], "drop --array"),
    (["train", "recipe=llama3", "--regenerate", "a.jsonl:b.jsonl"], "--regenerate serves the target"),
    (["train", "recipe=kimi_k2", *ONLINE, "--regenerate", "a.jsonl:b.jsonl"],
     "no data source reads b.jsonl; add data.sources.N.path=b.jsonl"),
    (["train", "recipe=kimi_k2", *ONLINE, "--regenerate", "a.jsonl"], "expected INPUT:OUTPUT"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(capsys, args, match):
    rc, out, err = _dry(capsys, *args)
    assert rc == 2 and not out, out
    assert len(err.strip().splitlines()) == 1 and err.startswith("submit: "), err
    assert re.search(match, err), err


def test_regenerate_block_serves_the_target_on_the_engine_nodes(capsys, tmp_path):
    rc, out, _ = _dry(capsys, "train", "recipe=kimi_k2", *ONLINE, f"run.output_root={tmp_path}",
                      "--regenerate", "sg.jsonl:/d/sg_regen.jsonl", "--regenerate", "uc.jsonl:/d/uc_regen.jsonl",
                      "data.sources.0.path=/d/sg_regen.jsonl", "data.sources.1.path=/d/uc_regen.jsonl",
                      "--regenerate-args", "--concurrency 64", "capture.engine_python=/opt/vllm/bin/python")
    assert rc == 0
    words = _knob(out, "REGENERATE")
    split = words.index("--")
    args = serve.parse_args(words)
    assert args.pairs == [("sg.jsonl", "/d/sg_regen.jsonl"), ("uc.jsonl", "/d/uc_regen.jsonl")]
    assert (args.model, args.tensor_parallel_size, args.engine_python) == (
        "moonshotai/Kimi-K2-Instruct-0905", 8, "/opt/vllm/bin/python")
    assert args.regenerate_args == "--concurrency 64" and args.log == tmp_path / "kimi_k2/logs/serve.log"
    assert words[split + 1:] == args.launcher == ["srun", "--het-group=1", "--nodes=1", "--ntasks=1", "--exact",
                                                  "--gpus-per-node=8", "--cpus-per-task=64"]
    cmd = serve.server_command(args, "gpu33", 20001)
    assert cmd[:3] == ["srun", "--nodelist=gpu33", "--het-group=1"]
    assert cmd[cmd.index("/opt/vllm/bin/python"):] == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "moonshotai/Kimi-K2-Instruct-0905", "--host", "0.0.0.0", "--port", "20001",
        "--tensor-parallel-size", "8", "--trust-remote-code"]
    assert not any("KEY" in w.upper() for w in words)  # the API key travels in the environment only
    body = out.split("# ---- end knobs ----")[1]
    assert body.index("fledge.train.slurm.serve") < body.index("fledge.train.slurm.launch")  # before training


FAKE_HET_SRUN = """#!/bin/bash
# fake srun of a het job: log the options, run the command once (the trainers' step: one node here)
echo "srun $*" >>"$FAKE_LOG.srun"
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 SLURMD_NODENAME=gpu01 SLURM_CPUS_PER_TASK="${SRUN_CPUS_PER_TASK:-}" "$@"
"""


def test_filled_het_script_runs_the_trainers_on_component_0(tmp_path):
    """What the batch shell of a het job sees (component 0's variables suffixed, no SLURM_CPUS_PER_TASK): the
    trainers' srun asks for --het-group=0 and the component's CPUs, the rendezvous is component 0's first node,
    the ledger names both components."""
    out = _write_scripts(tmp_path, "train", "recipe=llama3", *ONLINE, "--engine-nodes", "1")
    env = _fake_slurm(tmp_path, FAKE_HET_SRUN, FLEDGE_LAUNCH_DRY_RUN="1", SLURM_JOB_NODELIST="gpu01",
                      SLURM_NNODES="1", SLURM_HET_SIZE="2", SLURM_JOB_NODELIST_HET_GROUP_0="gpu01",
                      SLURM_JOB_NODELIST_HET_GROUP_1="gpu09", SLURM_CPUS_PER_TASK_HET_GROUP_0="64")
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(["bash", str(out / "llama3/slurm/train.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fake.log.srun").read_text().startswith("srun --het-group=0 --ntasks-per-node=1 ")
    cmd = shlex.split(next(x for x in res.stdout.splitlines() if "torch.distributed.run" in x))
    assert cmd[0] == "OMP_NUM_THREADS=8" and f"--rdzv_endpoint=10.1.0.1:{PORT_BASE + 999}" in cmd
    assert any(w.startswith("capture.engine_launcher=") for w in cmd)
    start = (out / "llama3/slurm/jobs.tsv").read_text().splitlines()[0].split("\t")
    assert start[4] == "gpu01+gpu09"


# ---- the regenerate phase (train/slurm/serve.py) ------------------------------------------------------

def test_serve_finds_the_engine_node_and_skips_finished_pairs(tmp_path):
    assert serve.engine_node({"SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[09-10]"}) == "gpu09"
    with pytest.raises(ValueError, match="--engine-nodes"):
        serve.engine_node({"SLURM_JOB_NODELIST": "gpu01"})
    assert serve.default_port({"SLURM_JOB_ID": "4711023"}) == PORT_BASE + 4711024 % PORT_SPAN
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(conv) for _ in range(3)) + "\n")
    assert serve.pending((str(inp), str(outp)), []) == 3
    assert serve.pending((str(inp), str(outp)), ["--max-samples", "2"]) == 2
    outp.write_text("".join(json.dumps({"index": i, **conv}) + "\n" for i in range(3)))
    assert serve.pending((str(inp), str(outp)), []) == 0
    # every pair done: the target is not served (no het job variables needed, nothing started)
    rc = serve.main(["--model", "m", "--log", str(tmp_path / "serve.log"), "--pair", f"{inp}:{outp}", "--",
                     "srun", "--het-group=1"])
    assert rc == 0 and not (tmp_path / "serve.log").exists()


FAKE_SERVER = """import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        n = int(self.headers["Content-Length"]); self.rfile.read(n)
        ok = self.headers.get("Authorization") == "Bearer " + os.environ.get("VLLM_API_KEY", "")
        body = b'{"choices": [{"message": {"content": "new"}, "finish_reason": "stop"}]}'
        self.send_response(200 if ok else 401); self.end_headers(); self.wfile.write(body if ok else b"{}")
    def log_message(self, *a): pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_serve_waits_for_health_regenerates_and_stops_the_server(tmp_path, monkeypatch):
    """The whole phase with a stand-in server (the launcher prefix is `env`, the engine python ours running a tiny
    HTTP server): /health, then `fledge regenerate` against it with the key from FLEDGE_API_KEY, then stopped."""
    import socket as _socket

    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(conv) + "\n" + json.dumps(conv) + "\n")
    fake = tmp_path / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", fake):
        (d / "__init__.py").write_text("")
    (fake / "api_server.py").write_text(FAKE_SERVER)
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "localhost")
    monkeypatch.setenv("FLEDGE_API_KEY", "s3cret")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(serve, "node_addr", lambda node, timeout=30: "127.0.0.1")
    log = tmp_path / "serve.log"
    rc = serve.main(["--model", "m", "--engine-python", sys.executable, "--log", str(log), "--port", str(port),
                     "--wait-s", "60", "--pair", f"{inp}:{outp}", "--regenerate-args", "--concurrency 1", "--",
                     "env"])
    assert rc == 0, log.read_text()
    rows = [json.loads(x) for x in outp.read_text().splitlines()]
    assert [r["messages"][1]["content"] for r in rows] == ["new", "new"]
    with pytest.raises(OSError):  # stopped
        _socket.create_connection(("127.0.0.1", port), timeout=2).close()
