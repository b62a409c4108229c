#!/usr/bin/env python
"""Fledge against vLLM's speculators 0.9.0 at the same budget: the peer trains an EAGLE-3 drafter for the same target
on the same rows, target states, tokens, TTT length and draft vocabulary as a Fledge run, with its own defaults
otherwise, and again with Fledge's optimizer settings (so the recipe and the code are told apart); then the three
drafters are scored on the same held-out rows and served by vLLM beside n-gram lookup.

    python scripts/compare_peer.py outputs/smollm2 --recipe smollm2            # a real target: MT-Bench + HumanEval
    python scripts/compare_peer.py outputs/peer_tiny --recipe tiny --sets heldout -- train.max_steps=100

RUN is a Fledge run directory (``outputs/<run.name>``); the stages it lacks (prepare, capture, train, export) are run
by ``fledge run recipe=RECIPE run.name=... OVERRIDES`` (the overrides after ``--``: those the run was made with). Then,
under ``--out`` (default ``<RUN>_peer``), each stage kept while what it was made from is unchanged:

1. ``data/``: RUN's train and eval stores in the peer's offline format (scripts/peer_store.py; kept per capture).
2. ``fledge_speculators/``: Fledge's export of RUN's checkpoint in the speculators dialect, for the scorer: a run
   directory whose prepare, capture and train are links to RUN's, where ``run.stages=[export]`` runs only export.
3. ``peer_default/``, ``peer_fledge_optim/``: the peer's own trainer on CPU (scripts/compare_peer_side.py), its step
   count computed from Fledge's tokens with its own packer (kept per plan: data, budget, optimizer, seed). ``--peers``
   picks one of them (each takes ~2.4x Fledge's time per step on 2 CPU cores). Its seed is its default (42) plus
   RUN's ``run.seed``: a second seed of the comparison is a second Fledge run with ``run.seed=1``.
4. ``heldout.json``: every drafter's agreement per TTT step on the held-out rows, one scorer for all three.
5. ``bench.json``: scripts/bench_real_target.py serving the three exports in vLLM beside n-gram lookup, on MT-Bench and
   HumanEval, or (``--sets heldout``) RUN's held-out prompts, for a target that speaks its own language.
6. ``compare.md`` / ``compare.json``: the tables (also printed), with the machine, the date and the command.

Each stage prints a line every few seconds; bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from fledge.run_layout import RunLayout

REPO = Path(__file__).resolve().parents[1]


def _sibling(name: str):
    """scripts/<name>.py, loaded from its file (scripts/ is not a package, and nothing edits sys.path)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


peer_store = _sibling("peer_store")

FLEDGE_STAGES = ("prepare", "capture", "train", "export")
PEERS = ("peer_default", "peer_fledge_optim")
ORACLE = REPO / ".oracle" / "site"
HEARTBEAT_S = 10.0


class Refused(Exception):
    """Bad input: one line, exit code 2."""


def run_config(run: Path) -> dict:
    """The config RUN's last command ran with (its config.yaml)."""
    return yaml.safe_load(RunLayout(run).config.read_text())


def stage_manifest(run: Path, stage: str) -> dict | None:
    """The stage's manifest when it is complete (fledge/run_layout.py: ``<run>/<stage>/manifest.json``)."""
    path = RunLayout(run).manifest(stage)
    m = json.loads(path.read_text()) if path.exists() else None
    return m if m and m.get("complete") else None


def fledge(args: list[str], log: Path) -> None:
    """``python -m fledge run ARGS`` (its output to ``log``, progress lines echoed); a failure is Refused with its
    last line."""
    cmd = [sys.executable, "-m", "fledge", "run", *args]
    print(f"[fledge] {' '.join(cmd[2:])}  (log: {log})", flush=True)
    run_logged(cmd, log, lambda line: "INFO fledge" in line or line.startswith(("train:", "capture")))


def run_logged(cmd: list[str], log: Path, echo, env: dict | None = None, status=None) -> None:
    """Run ``cmd`` with its output appended to ``log``; lines for which ``echo`` holds are printed as they come, and
    after HEARTBEAT_S seconds without one a line with the time so far (and ``status()``, when given)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    last, shown, t0, stop = "", [time.time()], time.time(), threading.Event()

    def heartbeat():
        while not stop.wait(HEARTBEAT_S):
            if time.time() - shown[0] >= HEARTBEAT_S:
                shown[0] = time.time()
                print(f"  ... {time.time() - t0:.0f} s{': ' + status() if status else ''}", flush=True)

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        with open(log, "a") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                   env=env) as p:
            for line in p.stdout:
                f.write(line)
                for part in line.replace("\r", "\n").splitlines():
                    last = part.strip() or last
                    if echo(part):
                        shown[0] = time.time()
                        print(f"  {part.strip()}", flush=True)
    finally:
        stop.set()
    if p.returncode:
        raise Refused(f"{' '.join(str(c) for c in cmd[1:3])} ... failed (exit {p.returncode}; {log}): {last}")


def ensure_fledge(run: Path, recipe: str | None, overrides: list[str], out: Path) -> None:
    """Run the Fledge stages RUN lacks, then its export in the speculators dialect beside it (stage 2)."""
    base = [f"run.name={run.name}", f"run.output_root={run.parent}", *overrides]
    missing = [s for s in FLEDGE_STAGES if stage_manifest(run, s) is None]
    if missing:
        if not recipe:
            raise Refused(f"{run}: stages {missing} are not complete; give --recipe (and the overrides the run "
                          "was made with after --) to run them")
        fledge([f"recipe={recipe}", *base, f"run.stages=[{','.join(FLEDGE_STAGES)}]"], out / "fledge.log")
    spec = out / "fledge_speculators"  # the CLI skips its export while RUN's checkpoint is the one it exported
    for stage in ("prepare", "capture", "train"):
        link = RunLayout(spec).stage(stage)
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(RunLayout(run).stage(stage), spec))
    recipe = recipe or run_config(run).get("recipe")
    fledge([f"recipe={recipe}", *overrides, f"run.name={spec.name}", f"run.output_root={out}",
            "export.format=speculators", "run.stages=[export]"], out / "fledge.log")


def fledge_budget(run: Path) -> dict:
    """What Fledge's run trained on: tokens (the train store's tokens x epochs consumed; a partial epoch at the
    epoch's mean), optimizer steps, tokens per step, wall clock, the exported step and its optimizer settings."""
    cfg = run_config(run)
    train = stage_manifest(run, "train")
    out, tcfg = train["outputs"], cfg["train"]
    store = json.loads((Path(stage_manifest(run, "capture")["outputs"]["store"]["train"])).read_text())
    epochs = out["global_batches"] / out["global_batches_per_epoch"]
    return {"tokens": round(store["num_tokens"] * epochs), "epochs": epochs, "steps": out["steps"],
            "step_tokens": tcfg["micro_batch_tokens"] * tcfg["micro_batch_size"] * out["global_batches_per_step"],
            "seconds": train["seconds"], "best_step": out.get("best_step"),
            "export_checkpoint": cfg["export"]["checkpoint"], "optim": tcfg["optim"], "seed": cfg["run"]["seed"],
            "ttt_steps": cfg["drafter"]["ttt_steps"], "target": cfg["target"]["name_or_path"]}


def peer_env(out: Path) -> dict:
    """The peer's process: .venv's python with .oracle/site first and a python-dotenv stand-in after it
    (pydantic-settings imports ``dotenv_values``; the peer's config turns every env and dotenv source off)."""
    shim = out / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "dotenv.py").write_text("def dotenv_values(*args, **kwargs):\n    return {}\n")
    return {**os.environ, "PYTHONPATH": f"{ORACLE}:{shim}", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def fledges_optim(o: dict) -> dict:
    """The run's ``train.optim`` as the peer_fledge_optim plan carries it: AdamW's settings, and Muon's group when the
    run trained with Muon (train/optimizers.py: its lr is train.optim.lr when null)."""
    plan = {"name": o.get("name", "adamw"), "lr": o["lr"], "warmup_steps": o["warmup_steps"],
            "schedule": o["schedule"], "grad_clip": o["grad_clip"], "betas": o["betas"],
            "weight_decay": o["weight_decay"], "min_lr_ratio": o["min_lr_ratio"]}
    if plan["name"] == "muon":
        plan |= {"muon_lr": o["muon_lr"] or o["lr"], "muon_momentum": o["muon_momentum"],
                 "muon_weight_decay": o["muon_weight_decay"]}
    return plan


def train_peers(out: Path, budget: dict, data: dict, env: dict, names: tuple[str, ...] = PEERS) -> dict:
    """Stage 3: each peer run of ``names``, skipped when its done.json has the same plan (data, budget, optimizer).
    Returns {name: done record}."""
    optims = {"peer_default": None, "peer_fledge_optim": fledges_optim(budget["optim"])}
    done = {}
    for name in names:
        record = out / name / "done.json"
        plan = {"name": name, "out": str(out / name), "data": data, "budget_tokens": budget["tokens"],
                "total_seq_len": budget["step_tokens"], "ttt_steps": budget["ttt_steps"],
                "verifier": str(Path(budget["target"]).resolve()), "optim": optims[name],
                "run_seed": budget["seed"]}
        if not record.exists() or json.loads(record.read_text()).get("plan") != plan:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "plan.json").write_text(json.dumps(plan, indent=1))
            print(f"[{name}] training (log: {out / name / 'train.log'})", flush=True)
            side(["train", str(out / name / "plan.json")], out / name / "side.log", env)
        else:
            print(f"[{name}] kept ({record})", flush=True)
        done[name] = json.loads(record.read_text())
    return done


def side(args: list[str], log: Path, env: dict) -> None:
    """scripts/compare_peer_side.py in the peer's process; its progress lines are echoed."""
    cmd = [sys.executable, str(REPO / "scripts" / "compare_peer_side.py"), *args]
    run_logged(cmd, log, lambda line: line.startswith("[peer]"), env)


def heldout(out: Path, drafters: dict[str, Path], steps: int, env: dict, stamp: dict) -> dict:
    """Stage 4: the scorer over every drafter (heldout.json, kept while it scored these drafters)."""
    path = out / "heldout.json"
    if path.exists() and json.loads(path.read_text()).get("stamp") == stamp:
        print(f"[heldout] kept ({path})", flush=True)
        return json.loads(path.read_text())
    print(f"[heldout] scoring {', '.join(drafters)} on the held-out rows, {steps} steps", flush=True)
    side(["heldout", str(out / "data"), str(path), str(steps), *(f"{n}={d}" for n, d in drafters.items())],
         out / "heldout.log", env)
    record = {**json.loads(path.read_text()), "stamp": stamp}
    path.write_text(json.dumps(record, indent=1))
    return record


def bench(out: Path, run: Path, exports: dict[str, Path], args, stamp: dict) -> dict:
    """Stage 5: scripts/bench_real_target.py on the three exports (bench.json, kept while it served these
    drafters with these settings)."""
    path, key_path = out / "bench.json", out / "bench.key.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_real_target.py"), "--out", str(path), "--k", str(args.k),
           "--prompts", str(args.prompts), "--max-new", str(args.max_new),
           "--batch-sizes", *map(str, args.batch_sizes), "--algorithms", *(f"{n}={d}" for n, d in exports.items())]
    if args.sets == ["heldout"]:
        cmd += ["--request", str(heldout_request(run, out / "heldout_request.json"))]
    else:
        target = run_config(run)["target"]["name_or_path"]
        cmd += ["--target", target, "--sets", *args.sets]
    key = {"stamp": stamp, "cmd": cmd[1:]}
    if path.exists() and key_path.exists() and json.loads(key_path.read_text()) == key:
        print(f"[bench] kept ({path})", flush=True)
        return json.loads(path.read_text())
    print(f"[bench] vLLM: plain, {', '.join(exports)}, ngram (log: {out / 'bench.log'})", flush=True)
    run_logged(cmd, out / "bench.log", lambda line: line.startswith("|") or "Error" in line,
               status=lambda: last_engine_line(out))
    key_path.write_text(json.dumps(key))
    return json.loads(path.read_text())


def last_engine_line(out: Path) -> str:
    """The bench's progress: the last 'engine NAME SET: ...' line of its newest vLLM driver log (else its last line)."""
    logs = sorted(out.glob("bench_b*/engine.log"), key=lambda p: p.stat().st_mtime)
    lines = logs[-1].read_text(errors="replace").splitlines() if logs else []
    done = [ln for ln in lines if ln.startswith("engine ")]
    return done[-1] if done else (lines[-1][-100:] if lines else "vLLM starting")


def heldout_request(run: Path, path: Path) -> Path:
    """bench_real_target.py's ``--request`` from RUN's held-out split: each conversation's prompt is its tokens up
    to the first assistant token (prepare's loss mask), stop ids the prepare stage's end-of-turn ids."""
    from datasets import load_from_disk

    prep = RunLayout(run).prepare
    rows = load_from_disk(str(prep.split("eval")))
    prompts = [r["input_ids"][:r["loss_mask"].index(1)] for r in rows if 1 in r["loss_mask"]]
    cfg = run_config(run)
    request = {"target": str(Path(cfg["target"]["name_or_path"]).resolve()), "sets": {"heldout": prompts},
               "stop_token_ids": json.loads(prep.summary.read_text())["eot_ids"]}
    path.write_text(json.dumps(request))
    return path


def tables(run: Path, budget: dict, data: dict, peers: dict, held: dict, served: dict | None) -> tuple[str, dict]:
    """The comparison as markdown (printed and written) and as one JSON record."""
    steps = held["steps"]
    command = "python scripts/compare_peer.py " + " ".join(sys.argv[1:])
    lines = [f"`{command}`", "", f"{peer_store.machine()}, {time.strftime('%Y-%m-%d')}; target {budget['target']}; "
             f"{data['train_rows']} train rows ({data['train_tokens']} tokens), {data['eval_rows']} held-out rows "
             f"({data['eval_tokens']} tokens); TTT {budget['ttt_steps']}, draft vocab {data['draft_vocab_size']}",
             "", "| trainer | tokens | steps | batch fill | train wall s | held-out agreement, steps 1.." + str(steps)
             + " | AL estimate |", "|---|---|---|---|---|---|---|"]
    fill = budget["tokens"] / (budget["steps"] * budget["step_tokens"])
    exported = f" (exported step {budget['best_step']})" if budget["best_step"] not in (None, budget["steps"]) else ""
    approx = "~" if budget["epochs"] % 1 else ""  # a partial epoch counted at the epoch's mean
    rows = {"fledge": (f"{approx}{budget['tokens']:,}", f"{budget['steps']}{exported}", fill, budget["seconds"])}
    for name, d in peers.items():
        rows[name] = (f"{d['tokens']:,}", str(d["steps"]), d["tokens"] / (d["steps"] * d["total_seq_len"]),
                      d["seconds"])
    for name, (tok, st, f, s) in rows.items():
        h = held["drafters_scores"][name]
        agree = " / ".join(f"{a:.3f}" for a in h["full_acc"])
        lines.append(f"| {name} | {tok} | {st} | {f:.1%} | {s:.0f} | {agree} | {h['al_estimate']:.2f} |")
    if served:
        lines += ["", f"vLLM {served['dtype']}, k={served['k']}, {served['max_new_tokens']} new tokens, "
                  f"{', '.join(f'{n}: {c} prompts' for n, c in served['prompts'].items())}", "",
                  "| set @ batch | proposer | AL | tokens / forward | accepted per position | tok/s (x plain) | "
                  "greedy equal |", "|---|---|---|---|---|---|---|"]
        for key, r in served["runs"].items():
            lines.append(f"| {key} | plain | 1.00 | 1.00 | | {r['plain']['tokens_per_s']:.1f} (1.00x) | |")
            for conf in (*rows, "ngram"):
                d = r[conf]
                at = " ".join(f"{a:.2f}" for a in d["accept_at"])
                per_forward = f"{d['per_forward']:.2f}" if "per_forward" in d else ""  # bench.json before it
                lines.append(f"| {key} | {conf} | {d['al']:.2f} | {per_forward} | {at} | {d['tokens_per_s']:.1f} "
                             f"({d['speedup']:.2f}x) | {d['greedy_equal']}/{served['prompts'][key.split('@')[0]]} |")
    record = {"command": command, "run": str(run), "machine": peer_store.machine(),
              "date": time.strftime("%Y-%m-%d"),
              "fledge": budget, "data": data, "peers": peers, "heldout": held, "served": served}
    return "\n".join(lines) + "\n", record


def parse(argv: list[str] | None):
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the Fledge run directory, outputs/<run.name>")
    ap.add_argument("--recipe", help="the run's recipe, to run its missing stages (default: its config.yaml's)")
    ap.add_argument("--out", type=Path, help="where the comparison lives (default: <RUN>_peer)")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval"],
                    help="bench_real_target.py's sets, or 'heldout': the run's held-out prompts (a tiny target)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k", type=int, default=5, help="draft tokens served, and the steps the scorer unrolls")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--skip-bench", action="store_true", help="stop before serving (no vLLM)")
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS),
                    help="the peer runs to train and compare (default: both; each ~2.4x Fledge's step time on CPU)")
    args = ap.parse_args(argv)
    args.overrides, args.run = overrides, args.run.resolve()
    args.out = (args.out or args.run.with_name(args.run.name + "_peer")).resolve()
    if "heldout" in args.sets and len(args.sets) > 1:
        raise Refused(f"--sets {' '.join(args.sets)}: 'heldout' is the run's own prompts, not one set among others")
    if not (ORACLE / "speculators").is_dir():
        raise Refused(f"no speculators at {ORACLE}: run scripts/setup_oracle.sh first")
    if not args.run.is_dir() and not args.recipe:
        raise Refused(f"{args.run}: no such run directory; give --recipe to make it")
    if min(args.k, args.prompts, args.max_new, *args.batch_sizes) < 1:
        raise Refused("--k, --prompts, --max-new and --batch-sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        args.out.mkdir(parents=True, exist_ok=True)
        ensure_fledge(args.run, args.recipe, args.overrides, args.out)
        budget = fledge_budget(args.run)
        data = peer_store.convert_run(args.run, args.out / "data")
        env = peer_env(args.out)
        peers = train_peers(args.out, budget, data, env, tuple(dict.fromkeys(args.peers)))
        exports = {"fledge": RunLayout(args.run).export.drafter,
                   **{n: Path(d["checkpoint"]) for n, d in peers.items()}}
        spec = RunLayout(args.out / "fledge_speculators")
        scored = {**exports, "fledge": spec.export.drafter}
        stamp = {"fledge": stage_manifest(spec.root, "export")["output_id"],
                 **{n: d["finished"] for n, d in peers.items()}}
        held = heldout(args.out, scored, args.k, env, stamp)
        served = None if args.skip_bench else bench(args.out, args.run, exports, args, stamp)
    except (Refused, peer_store.StoreError) as e:
        print(f"compare_peer: {e}", file=sys.stderr)
        return 2
    text, record = tables(args.run, budget, data, peers, held, served)
    (args.out / "compare.md").write_text(text)
    (args.out / "compare.json").write_text(json.dumps(record, indent=1))
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
