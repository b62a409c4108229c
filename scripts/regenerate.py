"""Re-answer a chat data set's user turns with the target (see data/regenerate.py).

    .venv/bin/python scripts/regenerate.py --input data.jsonl --output regen.jsonl \
        --endpoint http://127.0.0.1:8000/v1 --model meta-llama/Llama-3.1-8B-Instruct --concurrency 64
    .venv/bin/python scripts/regenerate.py --input data.jsonl --output regen.jsonl --in-process .cache/tiny_target/quick

Rerunning the same command resumes. Point data.sources[].path at the output afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.regenerate import OpenAIBackend, TransformersBackend, regenerate  # noqa: E402
from data.sources import DataError, iter_rows, normalize  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="jsonl / json / parquet file, datasets dir or hub id")
    ap.add_argument("--split", default="train")
    ap.add_argument("--max-samples", type=int)
    ap.add_argument("--output", required=True, help="append-only jsonl (resumed when it exists)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="OpenAI-compatible base url, e.g. http://127.0.0.1:8000/v1")
    src.add_argument("--in-process", metavar="MODEL_DIR", help="generate with transformers in this process")
    ap.add_argument("--model", help="served model name (with --endpoint)")
    ap.add_argument("--api-key")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="with --in-process")
    a = ap.parse_args(argv)
    if a.endpoint and not a.model:
        ap.error("--endpoint needs --model (the name the server serves)")
    backend = (OpenAIBackend(a.endpoint, a.model, a.api_key) if a.endpoint
               else TransformersBackend.from_pretrained(a.in_process, device=a.device))
    convs, bad = [], 0
    for row in iter_rows(a.input, a.split, a.max_samples):
        try:
            if row.error:
                raise DataError(row.where, row.error)
            convs.append({**normalize(row.record, row.where), "source": a.input, "index": row.index})
        except DataError as e:
            bad += 1
            print(f"skipped {e}", file=sys.stderr)
    stats = regenerate(convs, a.output, backend, a.temperature, a.max_tokens, a.concurrency)
    print(json.dumps({**stats, "bad_rows": bad, "output": a.output}, indent=2))
    return 1 if stats["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
