"""Memory of the teacher / draft-vocab path at a very large vocabulary (Kimi-K2's V=163840) vs V=32000.

    python scripts/bench_vocab.py [--hidden 2048] [--vd 32000] [--tokens 2000000]

For each V, a target directory with an untied bf16 lm_head [V, H] (and its embedding) is written to a temp
dir; then each measurement runs in a fresh process and reports its peak resident memory above what the
process held before (VmHWM, reset just before the work, minus the RSS then; Linux only):
  draft vocab   counting --tokens masked ids (data/prepare/vocab.py count_masked) and building the Vd map
  teacher rows  models/weights.py load_lm_head_rows: Vd rows read in row blocks (the path training uses)
  baseline      the whole lm_head read, then the Vd rows taken (the earlier path), in the same run
Ratios are V=163840 over V=32000 for each path. The teacher rows themselves are Vd x H x 2 bytes whatever V
is; what the block reader adds is one block (models/weights.py ROW_BLOCK_BYTES).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0): a forked child starts with its parent's high-water mark,
    and the setup's own peak must not count either."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(kind: str, target: str, V: int, vd: int, tokens: int) -> dict:
    import numpy as np

    from fledge.data.prepare.vocab import DraftVocab, count_masked
    from fledge.models.weights import load_lm_head_rows, read_tensors

    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, size=tokens) - 1, V - 1).astype(np.int64)  # a long-tailed id stream
    mask = np.ones(tokens, dtype=bool)
    selected = DraftVocab.build(count_masked(ids, mask, V), vd).selected
    del ids, mask
    import gc

    gc.collect()
    _reset_peak()
    before = _status("VmRSS")
    if kind == "draft_vocab":
        rng = np.random.default_rng(1)
        counts = None
        for _ in range(0, tokens, 1 << 18):  # as prepare counts: batch by batch
            chunk = np.minimum(rng.zipf(1.2, size=1 << 18) - 1, V - 1)
            counts = count_masked(chunk, np.ones(len(chunk), dtype=bool), V, counts)
        out = DraftVocab.build(counts, vd)
        nbytes = out.d2t.numel() * 8
    elif kind == "teacher_rows":
        out = load_lm_head_rows(target, None, selected)
        nbytes = out.numel() * out.element_size()
    else:  # baseline: the whole head, then the rows
        w = read_tensors(target, ["lm_head.weight"])["lm_head.weight"]
        out = w[selected].clone()
        del w
        nbytes = out.numel() * out.element_size()
    return {"extra_peak_mib": (_status("VmHWM") - before) / MiB, "result_mib": nbytes / MiB}


def _write_target(root: Path, V: int, H: int) -> Path:
    import torch
    from safetensors.torch import save_file

    d = root / f"v{V}"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    w = torch.empty(V, H, dtype=torch.bfloat16)
    for i in range(0, V, 8192):  # bf16 blocks: the parent never holds an fp32 [V, H]
        w[i:i + 8192] = torch.randn(min(8192, V - i), H, generator=g) * 0.02
    save_file({"lm_head.weight": w, "model.embed_tokens.weight": w[:1].clone()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False, "vocab_size": V, "hidden_size": H}))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vd", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 163840])
    ap.add_argument("--child", nargs=3, metavar=("KIND", "TARGET", "V"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], int(a.child[2]), a.vd, a.tokens)))
        return
    from fledge.models.precision import describe_cpu

    print(f"machine: {describe_cpu()}; H={a.hidden}, Vd={a.vd}, {a.tokens:,} masked tokens, bf16 lm_head")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for V in a.vocabs:
            target = _write_target(Path(tmp), V, a.hidden)
            for kind in ("draft_vocab", "teacher_rows", "baseline"):
                out = subprocess.run([sys.executable, __file__, "--child", kind, str(target), str(V), "--vd",
                                      str(a.vd), "--tokens", str(a.tokens)], capture_output=True, text=True, check=True)
                res[(kind, V)] = json.loads(out.stdout.strip().splitlines()[-1])
            (target / "model.safetensors").unlink()
    lo, hi = a.vocabs[0], a.vocabs[-1]
    print(f"{'path':<14}" + "".join(f"{'V=' + str(V) + ' extra peak MiB':>26}" for V in a.vocabs)
          + f"{'ratio':>8}{'kept MiB':>10}")
    for kind in ("draft_vocab", "teacher_rows", "baseline"):
        peaks = [res[(kind, V)]["extra_peak_mib"] for V in a.vocabs]
        print(f"{kind:<14}" + "".join(f"{p:>26.1f}" for p in peaks)
              + f"{peaks[-1] / max(peaks[0], 1e-9):>8.2f}{res[(kind, hi)]['result_mib']:>10.1f}")
    ratio = res[('teacher_rows', hi)]['extra_peak_mib'] / res[('baseline', hi)]['extra_peak_mib']
    print(f"teacher_rows at V={hi}: {ratio:.3f}x "
          f"the baseline's extra peak (V={lo}: "
          f"{res[('teacher_rows', lo)]['extra_peak_mib'] / res[('baseline', lo)]['extra_peak_mib']:.3f}x)")


if __name__ == "__main__":
    main()
