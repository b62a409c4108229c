"""The run directory, ``<run.output_root>/<run.name>/``, as one typed object: every path under it is named here.

::

    config.yaml                          the config the last command ran with (train/main.py)
    <stage>/manifest.json                each stage's inputs, their hash and its summary (pipeline/runner.py)
    prepare/train/ eval/ eval_perturbed/ tokenized splits (data/prepare/build.py)
    prepare/eval_conversations.jsonl     the eval split's conversations (eval_perturbed_... likewise)
    prepare/vocab.safetensors            the draft vocab (data/prepare/vocab.py), vocab.json its key
    prepare/summary.json                 what prepare kept, dropped and counted
    capture/<split>/                     a feature store per split (data/features/store.py)
    capture/slices/sliceNNNNN.json       array capture: the slices that finished (data/capture/offline.py)
    capture/engine/                      capture.engine=vllm: the engines' work directories
    train/checkpoints/                   resumable checkpoints and their drafter weights (train/checkpoint.py)
    train/metrics.jsonl                  the training log (train/metrics.py)
    train/best/                          the best checkpoint's drafter weights
    export/drafter/                      the serving directory (serving/export.py)
    eval/report.json, report.md, *.png   the eval report (evaluation/report.py)
    eval/engine/                         eval.engine=vllm: the engine's work directory (fledge/engine_process.py)
    slurm/<job>.sbatch                   `fledge submit`'s filled job scripts (pipeline/slurm/submit.py)
    logs/                                Slurm's job logs

Stages get this object from the runner and hand libraries the paths they need; no other module spells a
name of this tree (tests/unit/fledge/test_run_layout.py holds the source to that). Inside a store, a checkpoint
directory or an engine's work directory, the files are that library's own format.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG = "config.yaml"
MANIFEST = "manifest.json"


class PrepareDir:
    """What the prepare stage writes (data/prepare/build.py builds it in :meth:`staging` first)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def split(self, name: str) -> Path:
        """A tokenized split (``train``, ``eval``, ``eval_perturbed``): a ``datasets`` directory."""
        return self.root / name

    def conversations(self, split: str) -> Path:
        """The normalised conversations of an eval split, one JSON object a line."""
        return self.root / f"{split}_conversations.jsonl"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab.safetensors"

    @property
    def vocab_meta(self) -> Path:
        """The draft vocab's key and counts (beside :attr:`vocab`)."""
        return self.root / "vocab.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def staging(self) -> PrepareDir:
        """Where the stage builds its outputs before renaming them into place."""
        return PrepareDir(self.root / ".build")


class CaptureDir:
    """What the capture stage writes."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def store(self, split: str) -> Path:
        """The feature store of a prepared split."""
        return self.root / split

    def slice_record(self, index: int) -> Path:
        """The record that slice ``index`` of an array capture finished (every split, every rank)."""
        return self.root / "slices" / f"slice{index:05d}.json"

    @property
    def engine_work(self) -> Path:
        """capture.engine=vllm: where the engines keep their requests, token files, spools and logs."""
        return self.root / "engine"


class TrainDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def stream(self) -> Path:
        """capture.mode=online with capture.engine=vllm: each rank's engine work dir and bounded stream buffer."""
        return self.root / "stream"

    @property
    def best(self) -> Path:
        return self.root / "best"


class ExportDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"


class EvalDir:
    """The eval report and its plots (in :attr:`root`), and the engine's work directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def partial_json(self) -> Path:
        """The report so far, rewritten after each set while the stage runs (a cut eval keeps what it measured)."""
        return self.root / "report.partial.json"

    @property
    def engine_work(self) -> Path:
        return self.root / "engine"


class RunLayout:
    """``outputs/<run>/`` (module docstring). ``RunLayout.of(cfg.run)`` or ``RunLayout(path)``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.prepare = PrepareDir(self.stage("prepare"))
        self.capture = CaptureDir(self.stage("capture"))
        self.train = TrainDir(self.stage("train"))
        self.export = ExportDir(self.stage("export"))
        self.eval = EvalDir(self.stage("eval"))

    @classmethod
    def of(cls, run) -> RunLayout:
        """The layout of ``run`` (a ``RunConfig``: ``output_root`` / ``name``). A name that is not one plain
        directory name (``..``, ``a/b``, an absolute path) would put the run, and what its forces delete,
        outside ``run.output_root``: ValueError, one line."""
        name = str(run.name)
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"run.name={name!r}: not a plain directory name, so the run directory would not be "
                             f"a directory of run.output_root ({run.output_root}); pick a name without '/' that is "
                             "not '.' or '..' (e.g. run.name=my_run)")
        return cls(Path(run.output_root) / name)

    def stage(self, name: str) -> Path:
        """A stage's directory."""
        return self.root / name

    def manifest(self, stage: str) -> Path:
        return self.stage(stage) / MANIFEST

    def share_stage(self, name: str, source: RunLayout) -> None:
        """Make this run's ``name`` directory a relative symlink to ``source``'s (runs over seeds reading one
        prepared data set and one capture, fledge/pipeline/seeds.py); an existing directory or link is kept."""
        link = self.stage(name)
        if not link.is_symlink() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(source.stage(name), link.parent))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    def slurm_script(self, job: str) -> Path:
        return self.root / "slurm" / f"{job}.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"
