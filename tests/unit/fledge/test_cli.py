"""The ``fledge`` command's dispatch (fledge/cli.py): each command reaches its tool through an import statement
the import graph sees, and ``fledge --help`` loads no tool."""

import ast
import inspect
import subprocess
import sys

import pytest

from fledge import cli


def _static_imports() -> set[str]:
    """The modules fledge/cli.py names in ``from X import ...`` statements, wherever they stand."""
    tree = ast.parse(inspect.getsource(cli))
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_loads_its_entry_through_a_static_import(name):
    load, help_ = cli.COMMANDS[name]
    entry = load()
    assert callable(entry) and help_, name
    assert entry.__module__ == "fledge.cli" or entry.__module__ in _static_imports(), (
        f"`fledge {name}` reaches {entry.__module__}.{entry.__name__} without an import statement in fledge/cli.py")


def test_help_lists_every_command_and_imports_no_tool():
    """The real entry point, `python -m fledge --help`: every command on its own line, and no module beyond the
    dispatcher imported (a tool's imports cost seconds; -X importtime names every module the process loaded)."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "fledge", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    listed = {line.split()[0] for line in res.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(cli.COMMANDS)
    loaded = {line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "transformers", "hydra", "omegaconf", "numpy")}
    tools = {m for m in loaded if m.startswith("fledge.") and m != "fledge.cli"}
    assert not heavy and not tools, f"`fledge --help` imported {sorted(heavy | tools)}"


def test_an_unknown_command_is_one_message_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["trian", "recipe=tiny"])
    assert exit_.value.code == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
