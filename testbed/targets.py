"""The tiny targets by name, and ``fledge tiny-target``, which builds them.

    fledge tiny-target [llama|moe|mla|mla_mtp|long] [--out .cache/tiny_target] [--steps N] [--device cpu|cuda]

``llama`` (the default) is recipe=tiny's target, ``moe`` and ``mla`` recipe=tiny_moe's and tiny_mla's
(testbed/tiny_writer.py builds all three on one language, tokenizer and data), ``mla_mtp`` the MLA target with
DeepSeek-V3's MTP module trained with it (testbed/tiny_mtp.py: what vLLM serves with ``method: mtp``), ``long``
recipe=tiny_long's (testbed/tiny_long.py). Each is cached under ``--out`` (testbed/tiny_target.py): a second run
returns at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fledge.atomic import read_json
from fledge.testbed import tiny_long, tiny_target, tiny_writer

TARGETS = ("llama", "moe", "mla", "mla_mtp", "long")  # each one's directory under --out


def build(name: str = "llama", root: Path | None = None, steps: int | None = None, device: str = "cpu") -> Path:
    """Build (once) the tiny target ``name`` (one of TARGETS) under ``root``; returns its from_pretrained
    directory. ``steps`` overrides the step count (smoke tests; part of the cache key), ``device`` is not."""
    if name not in TARGETS:
        raise ValueError(f"tiny target {name!r}: expected one of {list(TARGETS)}")
    if name == "long":
        return tiny_long.build_long_target(root, steps, device)
    return tiny_writer.build_target(name, root, steps, device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", nargs="?", default="llama", choices=TARGETS,
                    help="llama (recipe=tiny, the default), moe (Qwen3-MoE-shaped: recipe=tiny_moe), mla "
                         "(DeepSeek-V3-shaped: recipe=tiny_mla), mla_mtp (mla with an MTP module: vLLM's method mtp), "
                         "long (4,096 positions: recipe=tiny_long)")
    ap.add_argument("--out", type=Path, default=tiny_target.default_root())
    ap.add_argument("--steps", type=int, default=None, help="override the step count (smoke tests)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="train on this device (cuda: the same steps in fp32 on a GPU)")
    args = ap.parse_args(argv)
    path = build(args.name, args.out, args.steps, args.device)
    if args.name == "long":
        print(f"long training conversations (recipe=tiny_long): {tiny_long.build_long_data(args.out) / 'train.jsonl'}")
        print(f"AL-vs-context prompts (eval.long_context_source): {tiny_long.build_long_eval(args.out)}")
    m = read_json(path / "metrics.json")
    sets = ", ".join(f"{s} distinct-3 {m[s]['distinct3']:.2f} ({m[s]['non_degenerate']:.0%} non-degenerate)"
                     for s in m.get("sets", ()))
    print(f"{path}: held-out loss {m['heldout_loss']:.3f}, top-1 {m['heldout_top1']:.1%}"
          + (f", {sets}" if sets else "")
          + f"; {m['steps']} steps in {m['train_seconds']:.0f}s, {m['parameters'] / 1e6:.1f}M params")


if __name__ == "__main__":
    main()
