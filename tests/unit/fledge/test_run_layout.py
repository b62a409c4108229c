"""The run directory is one typed object (fledge/run_layout.py): no other module of the product spells a
name of that tree in a path, so the tree can be read (and changed) in one file."""

import ast
from pathlib import Path

from fledge.conf.schema import STAGES
from fledge.run_layout import RunLayout
from tests.helpers.paths import REPO as ROOT

ROOMS = ("fledge", "conf", "models", "data", "serving", "evaluation", "testbed", "train", "pipeline")
LAYOUT = ROOT / "fledge" / "run_layout.py"


def _layout_names() -> set[str]:
    """Every name run_layout.py joins into a path (``root / "checkpoints"``, f"{split}_conversations.jsonl"'s
    constant part), and the stage directories."""
    names = set(STAGES)
    for node in ast.walk(ast.parse(LAYOUT.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    names.add(side.value)
                elif isinstance(side, ast.JoinedStr):
                    names |= {v.value for v in side.values if isinstance(v, ast.Constant)
                              and not v.value.startswith(".")}  # not a bare suffix
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            names.add(node.value.value)  # CONFIG, MANIFEST
    return names


# Names the tree shares with other formats: a checkpoint's drafter/ weights (train/checkpoint.py), a
# tokenizer's vocab.json (data/capture/offline.py hashes a target's tokenizer files).
SHARED = {"drafter", "vocab.json"}


def _path_literals(path: Path, names: set[str]) -> list[str]:
    """``x / "name"`` or ``"name" / x`` with a layout name, and any string holding a layout file name."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value in names - SHARED:
                    out.append(f"{node.lineno}: {ast.get_source_segment(text, node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in names - SHARED:
            out.append(f"{node.lineno}: {node.value!r}")
    return out


def test_no_module_outside_the_layout_builds_a_run_dir_path():
    names = _layout_names()
    assert {"config.yaml", "manifest.json", "vocab.safetensors", "metrics.jsonl", "report.json", "checkpoints",
            "best", "slurm", "logs", "prepare", "eval"} <= names  # the scan reads the layout
    offenders = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            if path != LAYOUT:
                offenders += [f"{path.relative_to(ROOT)}:{hit}" for hit in _path_literals(path, names)]
    assert not offenders, offenders


def test_the_layout_names_each_path_once(tmp_path):
    run = RunLayout(tmp_path / "run")
    paths = [run.config, *(run.manifest(s) for s in STAGES), run.prepare.split("train"), run.prepare.vocab,
             run.prepare.vocab_meta, run.prepare.conversations("eval"), run.prepare.summary, run.capture.store("train"),
             run.capture.slice_record(3), run.capture.engine_work, run.train.checkpoints, run.train.metrics,
             run.train.best, run.export.drafter, run.eval.report_json, run.eval.report_md, run.eval.engine_work,
             run.slurm_script("train"), run.logs]
    assert len(set(paths)) == len(paths) and all(tmp_path / "run" in p.parents for p in paths)
    assert run.prepare.vocab == tmp_path / "run" / "prepare" / "vocab.safetensors"  # what existing runs hold
    assert run.capture.slice_record(3).name == "slice00003.json" and run.eval.report_json.parent == run.stage("eval")
