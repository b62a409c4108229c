"""A served target on Slurm without Slurm: fledge submit --engine-nodes renders one heterogeneous job (trainers =
component 0, engines = component 1 through capture.engine_launcher), refuses layouts that cannot run, runs its
filled script under a fake srun, and pipeline/slurm/serve.py's regenerate phase against a stand-in server."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fledge.pipeline.slurm import serve
from fledge.pipeline.slurm.launch import PORT_BASE, PORT_SPAN
from tests.helpers.fake_slurm import FAKE_SRUN_LONG, fake_slurm, submit_module, write_scripts
from tests.helpers.suites import FULL_ONLY

# ---- a served target: the heterogeneous job --------------------------------------------------------------

ONLINE = ["capture.mode=online", "capture.engine=vllm"]


def _dry(capsys, *args: str) -> tuple[int, str, str]:
    rc = submit_module().main([*args, "--dry-run"])
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
    launcher = submit_module().compose(["recipe=kimi_k2", *overrides]).capture.engine_launcher
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
    launcher = submit_module().compose(["recipe=llama3", *_knob(out, "OVERRIDES")]).capture.engine_launcher
    assert launcher[-2:] == ["--gpus-per-node=2", "--cpus-per-task=16"]
    # CPU engine nodes (as the test cluster): no GPUs asked for, the engines share the node's CPUs
    rc, out, _ = _dry(capsys, "train", "recipe=tiny", *ONLINE, "--engine-nodes", "1", "--engine-cpus-per-task", "4",
                      f"run.output_root={tmp_path}")
    launcher = submit_module().compose(["recipe=tiny", *_knob(out, "OVERRIDES")]).capture.engine_launcher
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
    (["train", "recipe=tiny", *ONLINE, "--engine-nodes", "1", "--engine-cpus-per-task", "0"],
     r"^submit: --engine-cpus-per-task 0: must be >= 1 \(CPUs per engine node\)$"),
    (["train", "recipe=llama3", "--nodes", "0"], r"^submit: --nodes 0: must be >= 1 \(trainer nodes\)$"),
    (["capture", "recipe=llama3", "--array", "4", "--max-parallel", "-1"],
     r"^submit: --max-parallel -1: must be >= 1 \(array tasks at once\)$"),
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


def test_a_push_the_jobs_cannot_make_is_refused_before_the_queue(capsys, monkeypatch):
    """The templates run the stages with HF_HUB_OFFLINE=1 unless the environment sbatch passes on says 0: a
    publish stage would have failed after the queue wait. With the Hub and a token there, it is submitted; a
    job without the publish stage never pushes."""
    hub = ["train", "recipe=tiny", "export.push_to_hub=true", "export.repo_id=me/tiny"]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    rc, out, err = _dry(capsys, *hub)
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert err.startswith("submit: export.push_to_hub=true: the Slurm job runs its publish stage with "
                          "HF_HUB_OFFLINE=1") and "export HF_HUB_OFFLINE=0 in the shell that runs sbatch" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    rc, out, err = _dry(capsys, *hub)
    assert rc == 2 and "export HF_TOKEN" in err, err
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert _dry(capsys, *hub)[0] == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _dry(capsys, *hub, "--stages", "[prepare,capture,train,export,eval]")[0] == 0


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
    cmd = serve.server_command(args, "gpu33", "10.1.0.33", 20001)
    assert cmd[:3] == ["srun", "--nodelist=gpu33", "--het-group=1"]
    assert cmd[cmd.index("/opt/vllm/bin/python"):] == [  # the node's cluster address, not every interface
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "moonshotai/Kimi-K2-Instruct-0905", "--host", "10.1.0.33", "--port", "20001",
        "--tensor-parallel-size", "8", "--trust-remote-code"]
    assert not any("KEY" in w.upper() for w in words)  # the API key travels in the environment only
    rc, out, _ = _dry(capsys, "train", "recipe=kimi_k2", *ONLINE, f"run.output_root={tmp_path}", "--no-api-key",
                      "--regenerate", "sg.jsonl:/d/sg_regen.jsonl", "data.sources.0.path=/d/sg_regen.jsonl")
    assert rc == 0 and serve.parse_args(_knob(out, "REGENERATE")).no_api_key
    body = out.split("# ---- end knobs ----")[1]
    assert body.index("fledge.pipeline.slurm.serve") < body.index("fledge.pipeline.slurm.launch")  # before training


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
    out = write_scripts(tmp_path, "train", "recipe=llama3", *ONLINE, "--engine-nodes", "1")
    env = fake_slurm(tmp_path, FAKE_HET_SRUN, FLEDGE_LAUNCH_DRY_RUN="1", SLURM_JOB_NODELIST="gpu01",
                      SLURM_NNODES="1", SLURM_HET_SIZE="2", SLURM_JOB_NODELIST_HET_GROUP_0="gpu01",
                      SLURM_JOB_NODELIST_HET_GROUP_1="gpu09", SLURM_CPUS_PER_TASK_HET_GROUP_0="64")
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(["bash", str(out / "llama3/slurm/train.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fake.log.srun").read_text().startswith("srun --het-group=0 --ntasks-per-node=1 ")
    cmd = shlex.split(next(x for x in res.stdout.splitlines() if "fledge.pipeline.torchrun" in x))
    assert cmd[0] == "OMP_NUM_THREADS=8" and f"--rdzv_endpoint=10.1.0.1:{PORT_BASE + 999}" in cmd
    assert any(w.startswith("capture.engine_launcher=") for w in cmd)
    start = (out / "llama3/slurm/jobs.tsv").read_text().splitlines()[0].split("\t")
    assert start[4] == "gpu01+gpu09"


# ---- the regenerate phase (pipeline/slurm/serve.py) ------------------------------------------------------

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


def test_a_conversation_too_long_for_the_server_does_not_keep_the_phase_pending(tmp_path, capsys):
    """vLLM refuses a prompt past its --max-model-len, and no rerun answers it: it is recorded (OUTPUT.too_long,
    counted), so the requeued job finds nothing pending and goes straight to training instead of starting the
    server again on every requeue."""
    from fledge.data.prepare.regenerate import TooLong, regenerate

    class Backend:
        name = "m"

        def complete(self, messages, temperature, max_tokens):
            if messages[-1]["content"] == "a very long question":
                raise TooLong("HTTP 400: This model's maximum context length is 2048 tokens.")
            return {"content": "new", "finish_reason": "stop"}

    convs = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}]}
             for q in ("hi", "a very long question", "yo")]
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(c) + "\n" for c in convs))
    stats = regenerate([{**c, "index": i} for i, c in enumerate(convs)], outp, Backend(), progress=False)
    assert (stats["done"], stats["too_long"], stats["failed"]) == (2, 1, 0)
    assert serve.pending((str(inp), str(outp)), []) == 0
    rc = serve.main(["--model", "m", "--log", str(tmp_path / "serve.log"), "--pair", f"{inp}:{outp}", "--",
                     "srun", "--het-group=1"])
    assert rc == 0 and not (tmp_path / "serve.log").exists()  # the target is not served again
    assert "nothing to regenerate" in capsys.readouterr().out
    again = regenerate([{**c, "index": i} for i, c in enumerate(convs)], outp, Backend(), progress=False)
    assert (again["done"], again["skipped_existing"], again["too_long"]) == (0, 2, 1)  # still counted


FAKE_SERVER = """import http.server, os, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        n = int(self.headers["Content-Length"]); self.rfile.read(n)
        time.sleep(float(os.environ.get("FAKE_ANSWER_S", "0")))
        ok = self.headers.get("Authorization") == "Bearer " + os.environ.get("VLLM_API_KEY", "")
        body = b'{"choices": [{"message": {"content": "new"}, "finish_reason": "stop"}]}'
        self.send_response(200 if ok else 401); self.end_headers(); self.wfile.write(body if ok else b"{}")
    def log_message(self, *a): pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake_vllm(tmp_path: Path) -> None:
    """``-m vllm.entrypoints.openai.api_server`` as FAKE_SERVER, for a python with ``tmp_path`` on its path."""
    fake = tmp_path / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", fake):
        (d / "__init__.py").write_text("")
    (fake / "api_server.py").write_text(FAKE_SERVER)


def test_serve_refuses_to_start_a_server_without_a_key_unless_told(tmp_path, monkeypatch, capsys):
    """No FLEDGE_API_KEY in the job (as when the card's key prefixed `fledge submit`, not the bash running sbatch):
    one line naming the fix, and no server started; --no-api-key serves with a warning."""
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(conv) + "\n")
    monkeypatch.delenv("FLEDGE_API_KEY", raising=False)
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_1", "localhost")
    monkeypatch.setattr(serve, "node_addr", lambda node, timeout=30: "127.0.0.1")
    started = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or 1 / 0)
    argv = ["--model", "m", "--log", str(tmp_path / "serve.log"), "--pair", f"{inp}:{tmp_path / 'out.jsonl'}",
            "--", "env"]
    assert serve.main(argv) == 2 and not started
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "FLEDGE_API_KEY" in err and "--no-api-key" in err, err
    with pytest.raises(ZeroDivisionError):  # it gets as far as starting the server
        serve.main(["--no-api-key", *argv])
    assert started and started[0][started[0].index("--host") + 1] == "127.0.0.1"
    assert "without an API key" in capsys.readouterr().err


def test_kimi_k2_card_hands_the_key_to_the_bash_that_runs_sbatch():
    """`FLEDGE_API_KEY=... fledge submit ... | bash` sets the key for `fledge submit` only; sbatch never sees it."""
    card = (Path(__file__).resolve().parents[3] / "recipes" / "kimi_k2" / "README.md").read_text()
    assert "FLEDGE_API_KEY" in card and not re.search(r"FLEDGE_API_KEY=\S*\s+fledge submit", card)
    assert re.search(r"(\| *FLEDGE_API_KEY=\S* +bash|export FLEDGE_API_KEY)", card)


def test_serve_waits_for_health_regenerates_and_stops_the_server(tmp_path, monkeypatch, capfd):
    """The whole phase with a stand-in server (the launcher prefix is `env`, the engine python ours running a tiny
    HTTP server): /health, then `fledge regenerate` against it with the key from FLEDGE_API_KEY, then stopped."""
    import socket as _socket

    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(conv) + "\n" + json.dumps(conv) + "\n")
    _fake_vllm(tmp_path)
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
    printed = capfd.readouterr()
    assert "s3cret" not in printed.out + printed.err + log.read_text()  # the key is in no output


# SIGINT and SIGHUP in the full suite (CI's 30 minutes): the phase forwards every signal by one handler, and
# regenerate's own per-signal tests (tests/unit/data/test_regenerate.py) are their CI twins.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=FULL_ONLY),
                                 pytest.param(signal.SIGHUP, marks=FULL_ONLY)], ids=lambda s: s.name)
def test_a_stopped_regenerate_phase_ends_regenerate_and_the_server_and_keeps_the_answers(tmp_path, sig):
    """The phase stopped (SIGTERM: what the batch script sends it at the time limit, before it requeues the job):
    `fledge regenerate` gets the signal and keeps its finished answers, the server is stopped, no process of the
    phase survives, and the exit code is 128 + the signal's, so the batch script requeues."""
    from tests.helpers.processes import descendants

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "NodeName=$3 NodeAddr=127.0.0.1"\n')
    (bin_dir / "scontrol").chmod(0o755)
    _fake_vllm(tmp_path)
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]}
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text((json.dumps(conv) + "\n") * 40)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu09",
           "FLEDGE_API_KEY": "s3cret", "PYTHONPATH": str(tmp_path), "FAKE_ANSWER_S": "0.2"}
    proc = subprocess.Popen([sys.executable, "-m", "fledge.pipeline.slurm.serve", "--model", "m", "--engine-python",
                             sys.executable, "--log", str(tmp_path / "serve.log"), "--port", str(port), "--wait-s",
                             "60", "--pair", f"{inp}:{outp}", "--regenerate-args", "--concurrency 2", "--", "env"],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not outp.exists() or len(outp.read_text().splitlines()) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the phase never answered:\n{proc.communicate()}")
        time.sleep(0.02)
    ours = [proc.pid, *descendants(proc.pid)]
    assert len(ours) >= 3  # the phase, its server, its `fledge regenerate`
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the phase still ran 60 s after {sig.name}: {proc.communicate()}")
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "s3cret" not in err, err
    time.sleep(0.2)
    left = [pid for pid in ours if Path(f"/proc/{pid}").exists()
            and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not left, f"processes of the phase outlived it: {left}"
    lines = outp.read_text().splitlines()
    assert 3 <= len(lines) < 40 and all(json.loads(x)["messages"][1]["content"] == "new" for x in lines)
    assert serve.pending((str(inp), str(outp)), []) == 40 - len(lines)  # a requeued job resumes the rest


FAKE_PHASE = """#!/bin/bash
# a python whose `-m fledge.pipeline.slurm.serve` is a regenerate phase that runs until SIGTERM, as one whose
# conversations outlast the job's time limit
trap 'echo term >>"$FAKE_LOG.phase"; exit 143' TERM
[ "$2" = fledge.pipeline.slurm.serve ] || exit 99
echo $$ >"$FAKE_LOG.phase_pid"
touch "$FAKE_LOG.phase"
while :; do sleep 0.05; done
"""


@pytest.mark.parametrize("restarts,requeued", [("0", True), ("5", False)])
def test_a_regenerate_phase_at_the_time_limit_is_stopped_and_requeued(tmp_path, restarts, requeued):
    """USR1 (5 minutes before the time limit) while the regenerate phase runs: the phase gets SIGTERM (it keeps its
    answers and stops the server) and the job is requeued like a training step, up to MAX_REQUEUES. Before, the
    phase ran in the foreground, so bash ran the USR1 trap only once it had ended: at the time limit, never
    requeued."""
    out = write_scripts(tmp_path, "train", "recipe=llama3", *ONLINE, "--engine-nodes", "1", "--regenerate",
                        "in.jsonl:/d/regen.jsonl", "data.sources.0.path=/d/regen.jsonl")
    script = out / "llama3/slurm/train.sbatch"
    (tmp_path / "phase-python").write_text(FAKE_PHASE)
    (tmp_path / "phase-python").chmod(0o755)
    text = script.read_text()
    script.write_text(re.sub(r"(?m)^PYTHON=.*$", f"PYTHON={tmp_path / 'phase-python'}", text, count=1))
    env = fake_slurm(tmp_path, FAKE_SRUN_LONG, SLURM_RESTART_COUNT=restarts)
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    phase = tmp_path / "fake.log.phase"
    deadline = time.time() + 30
    while not phase.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert phase.exists(), "the regenerate phase never started"
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 delivers to the batch shell
        stdout, _ = proc.communicate(timeout=30)
    finally:  # the fake phase holds the output pipe open: never leave it behind
        pids = [proc.pid] + [int(p.read_text()) for p in [tmp_path / "fake.log.phase_pid"] if p.exists()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 143, stdout
    assert phase.read_text().strip() == "term"
    assert not (tmp_path / "fake.log.srun_pid").exists(), "training started after a stopped phase"
    scontrol = tmp_path / "fake.log.scontrol"
    assert (scontrol.exists() and scontrol.read_text().strip() == "requeue 999") == requeued, stdout
    end = (out / "llama3/slurm/jobs.tsv").read_text().splitlines()[-1].split("\t")
    assert end[6] == ("exit 143 (regenerate) after USR1, requeued" if requeued
                      else "exit 143 (regenerate) after USR1, MAX_REQUEUES=5 reached")
