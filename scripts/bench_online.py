"""Online training from a vLLM engine against capture-then-train, on the tiny target, in one run.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_online.py [--target DIR] [--steps 20] [--samples 48]

Both arms train the same drafter on the same prepared data with the same batches (one rank, real vLLM from
.engine/venv): "capture-then-train" is `capture.engine=vllm` (the offline store) then training from it;
"online" is `capture.mode=online capture.engine=vllm` (data/capture/stream.py). Tokens are the trained
samples' tokens (the same in both arms); tokens/s divides them by the stages' own seconds (stage manifests;
for the offline arm capture + train). The stall fraction is the online trainer's time waiting on its
engine (engine start-up included) over the train stage's seconds. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def torchrun(*ov: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(34500 + os.getpid() % 2000), "train/main.py", *ov]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        sys.exit(res.stdout[-2000:] + res.stderr[-4000:])


def seconds(run: Path, stage: str) -> float:
    return json.loads((run / stage / "manifest.json").read_text())["seconds"]


def trained_tokens(run: Path, batches: int, row_tokens: int, rows: int, seed: int) -> int:
    from datasets import load_from_disk

    from fledge.data.capture.offline import dataset_lengths
    from fledge.data.features.reader import BatchIterator

    lengths = dataset_lengths(load_from_disk(str(run / "prepare" / "train")))
    plan = BatchIterator(lengths, 0, 1, row_tokens, rows, seed)
    n = plan.global_batches_per_epoch
    return sum(min(lengths[j], row_tokens) for g in range(batches)
               for row in plan.global_plan(g // n)[g % n] for j in row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="default: the tiny recipe's target (built once into .cache)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--buffer-batches", type=int, default=4)
    args = ap.parse_args()
    from fledge.testbed import targets, tiny_writer

    target = args.target or str(targets.build("llama"))
    data = tiny_writer.build_data()
    out = Path(tempfile.mkdtemp(prefix="bench_online_"))
    try:
        ov = ["recipe=tiny", f"run.output_root={out}", f"target.name_or_path={target}",
              f"data.sources=[{{path: {data}/train.jsonl, max_samples: {args.samples}}}]",
              f"data.eval_sources=[{{path: {data}/eval.jsonl, max_samples: 8}}]", "capture.batch_tokens=2048",
              f"train.max_steps={args.steps}", f"train.log_every={args.steps}", f"train.eval_every={10**6}",
              f"train.save_every={10**6}"]
        torchrun(*ov, "run.name=offline", "run.stages=[prepare]")
        (out / "online").mkdir()
        shutil.copytree(out / "offline" / "prepare", out / "online" / "prepare")
        torchrun(*ov, "run.name=offline", "run.stages=[capture,train]", "capture.engine=vllm")
        torchrun(*ov, "run.name=online", "run.stages=[train]", "capture.mode=online", "capture.engine=vllm",
                 f"capture.buffer_batches={args.buffer_batches}")
        from fledge.conf.compose import compose

        cfg = compose(ov)
        res = json.loads((out / "online" / "train" / "manifest.json").read_text())["outputs"]
        row_tokens, rows = cfg.train.micro_batch_tokens, cfg.train.micro_batch_size
        tokens = trained_tokens(out / "online", res["global_batches"], row_tokens, rows, cfg.run.seed)
        off_cap, off_train = seconds(out / "offline", "capture"), seconds(out / "offline", "train")
        on_train = seconds(out / "online", "train")
        off_tps, on_tps = tokens / (off_cap + off_train), tokens / on_train
        print(f"| arm | seconds | tokens/s | ratio |\n|---|---|---|---|\n"
              f"| capture-then-train (capture {off_cap:.1f} s + train {off_train:.1f} s) | {off_cap + off_train:.1f} "
              f"| {off_tps:.0f} | 1.00 |\n| online (vLLM stream, buffer {args.buffer_batches}) | {on_train:.1f} | "
              f"{on_tps:.0f} | {on_tps / off_tps:.2f} |\n\n{tokens} trained tokens, {res['global_batches']} batches; "
              f"online stall fraction {res['engine_wait_s'] / on_train:.2f} ({res['engine_wait_s']:.1f} s waiting on "
              f"the engine, start-up included, of {on_train:.1f} s)")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
