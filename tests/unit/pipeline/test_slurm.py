"""Slurm support without Slurm: node lists, the rendezvous from SLURM_* sets, the submit helper, and the
batch scripts executed under a fake srun/scontrol."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import pytest

from fledge.pipeline.slurm.launch import (
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
from tests.helpers.fake_slurm import FAKE_SRUN, FAKE_SRUN_LONG, fake_slurm, submit_module, write_scripts
from tests.helpers.paths import REPO

SLURM_DIR = REPO / "pipeline" / "slurm"


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
    assert cmd[:3] == ["py", "-m", "fledge.pipeline.torchrun"]
    i = cmd.index("train/main.py")
    assert "--rdzv_endpoint=gpu17:" + str(PORT_BASE + 4711023 % PORT_SPAN) in cmd[:i]
    assert cmd[i + 1:] == ["recipe=llama3", "run.stages=[capture]", "capture.slice_index=2", "capture.num_slices=4"]
    local = build_command(parse_args(["--nproc-per-node", "2", "train/main.py", "recipe=tiny"]), {}, python="py")
    assert local == ["py", "-m", "fledge.pipeline.torchrun", "--standalone", "--nproc_per_node=2", "train/main.py",
                     "recipe=tiny"]
    module = build_command(parse_args(["--nproc-per-node", "2", "fledge.train.main", "recipe=tiny"]), {}, python="py")
    assert module[-4:] == ["--nproc_per_node=2", "-m", "fledge.train.main", "recipe=tiny"]  # works from a wheel


# ---- batch scripts and the submit helper ------------------------------------------------------------

def test_the_three_scripts_share_one_body():
    bodies = {p.name: p.read_text().split("# ---- end knobs ----")[1] for p in SLURM_DIR.glob("*.sbatch")}
    assert set(bodies) == {"train.sbatch", "capture.sbatch", "capture_array.sbatch"}
    assert len(set(bodies.values())) == 1, "edit train.sbatch's body and copy it to the other two"


def test_dry_run_prints_filled_scripts_and_writes_nothing(tmp_path, capsys):
    submit = submit_module()
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
    submit = submit_module()
    assert submit.main(["train", "recipe=llama3", "train.no_such_key=1", "--dry-run"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_filled_train_script_runs_launch_on_every_node(tmp_path, capsys):
    out = write_scripts(tmp_path, "train", "recipe=llama3", "--nodes", "2", "logging.wandb_tags=[a b,c]")
    env = fake_slurm(tmp_path, FAKE_SRUN, FLEDGE_LAUNCH_DRY_RUN="1", SLURM_CPUS_PER_TASK="64")
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(["bash", str(out / "llama3/slurm/train.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line) for line in res.stdout.splitlines() if "fledge.pipeline.torchrun" in line]
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
    out = write_scripts(tmp_path, "train", "recipe=tiny")
    env = fake_slurm(tmp_path, FAKE_SRUN_LONG, SLURM_RESTART_COUNT=restarts)
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
    out = write_scripts(tmp_path, "train", "recipe=tiny")
    env = fake_slurm(tmp_path, FAKE_SRUN_LONG)
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
