"""The drafter checkpoint: the one on-disk form of a trained drafter, and the record an export keeps of it.

A drafter checkpoint directory (train writes one into every checkpoint, ``checkpoints/step_<N>/drafter/``, and
copies the best to ``best/``; export reads it)::

    model.safetensors   the drafter's full state dict: its own names (already the serving ones), training dtypes
    fledge.json         spec (``DrafterSpec.to_dict``), target (name_or_path, revision), training (how it was
                        trained: recipe, loss, flags, the train config), step, metrics

An export (serving/export.py) is the layout an engine loads (config.json, bf16 safetensors); beside them it
keeps ``fledge_training.json``, this checkpoint's :meth:`DrafterCheckpoint.record`: the spec, the flags the
drafter was trained with (``trained_with``), step, metrics and target. ``fledge lint`` compares config.json with
it, the model card and ``spec_from_export`` read it. Every file name of both is spelled here and nowhere else.

The drafter itself knows nothing of files (models/drafter.py); train builds what goes in (train/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fledge.atomic import atomic_path, read_json, write_json_atomic
from fledge.models.algorithms import DrafterSpec
from fledge.models.weights import read_tensors

WEIGHTS = "model.safetensors"
META = "fledge.json"
RECORD = "fledge_training.json"
RECORD_VERSION = 1
# The spec fields the record repeats as ``trained_with``: what the linter holds config.json to.
TRAINED_WITH = ("fc_norm", "norm_output", "norm_before_fc", "parallel_drafting", "aux_layer_ids", "draft_vocab_size",
                "vocab_size", "hidden_size", "max_position_embeddings")


@dataclass(frozen=True)
class DrafterCheckpoint:
    """What a drafter checkpoint says besides its weights. ``target``: ``{"name_or_path", "revision"}`` of the
    target it drafts for; ``training``: how it was trained (kept in the checkpoint, not in an export's record);
    ``step``: the optimizer steps behind its weights; ``metrics``: held-out figures for the model card."""

    spec: DrafterSpec
    target: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def at_step(self, step: int) -> DrafterCheckpoint:
        """This checkpoint's description for the weights after ``step`` optimizer steps."""
        return dataclasses.replace(self, step=step)

    # ------------------------------------------------------------------------------------- the directory
    def write(self, directory: str | Path, state_dict: dict[str, torch.Tensor]) -> Path:
        """Write ``state_dict`` (the drafter's, its own names) and this description into ``directory``,
        atomically (temp dir + rename: a kill leaves the old directory or none); returns the directory."""
        from safetensors.torch import save_file

        out = Path(directory)
        with atomic_path(out, "drafter-checkpoint") as tmp:  # replaces only what Fledge wrote (fledge/owned.py)
            tmp.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp / WEIGHTS))
            write_json_atomic(tmp / META, self.to_json())
        return out

    @classmethod
    def read(cls, directory: str | Path) -> DrafterCheckpoint:
        """The description in ``directory``; ValueError naming the path when it is not a drafter checkpoint
        (a file missing) or its ``fledge.json`` is not one (bad JSON, no or a bad spec)."""
        d = Path(directory)
        missing = [n for n in (WEIGHTS, META) if not (d / n).is_file()]
        if missing:
            raise ValueError(f"{d}: not a Fledge drafter checkpoint (no {' and no '.join(missing)}; it needs "
                             f"{WEIGHTS} and {META})")
        return cls.from_json(read_json(d / META) or {}, d / META)

    @staticmethod
    def tensors(directory: str | Path) -> dict[str, torch.Tensor]:
        """The state dict in ``directory``'s ``model.safetensors``; ValueError naming the file when it cannot
        be read."""
        path = Path(directory) / WEIGHTS
        try:
            return read_tensors(Path(directory))
        except ValueError:
            raise
        except Exception as e:  # safetensors' own error types for a truncated or garbled file
            raise ValueError(f"{path}: not a readable safetensors file ({e}); train again or restore it") from None

    # ------------------------------------------------------------------------------------------ the JSON
    def to_json(self) -> dict[str, Any]:
        """The ``fledge.json`` payload."""
        return {"spec": self.spec.to_dict(), "target": dict(self.target), "training": dict(self.training),
                "step": self.step, "metrics": dict(self.metrics)}

    @classmethod
    def from_json(cls, meta: dict[str, Any], where: str | Path = META) -> DrafterCheckpoint:
        """The inverse of :meth:`to_json`; ``where`` names the file in its error."""
        unknown = set(meta) - {f.name for f in dataclasses.fields(cls)}
        if unknown or not isinstance(meta.get("spec"), dict):
            raise ValueError(f"{where}: not a drafter checkpoint's description ("
                             + (f"unknown keys {sorted(unknown)}" if unknown else "no spec") + ")")
        try:
            spec = DrafterSpec.from_dict(meta["spec"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: its spec is not a drafter's ({e})") from None
        return cls(spec, dict(meta.get("target") or {}), dict(meta.get("training") or {}), meta.get("step"),
                   dict(meta.get("metrics") or {}))

    # ---------------------------------------------------------------------------------- an export's record
    def record(self) -> dict[str, Any]:
        """The ``fledge_training.json`` payload an export keeps beside its config.json."""
        spec = self.spec.to_dict()
        return {"format_version": RECORD_VERSION, "trained_with": {k: spec.get(k) for k in TRAINED_WITH},
                "spec": spec, "step": self.step, "metrics": dict(self.metrics), "target": dict(self.target)}

    def write_record(self, directory: str | Path) -> None:
        """Write :meth:`record` into ``directory`` (an export being written)."""
        write_json_atomic(Path(directory) / RECORD, self.record())

    @staticmethod
    def read_record(directory: str | Path) -> dict[str, Any] | None:
        """The record in an export ``directory`` as written (a dict: the linter judges records edited by hand
        or partly missing), or None where there is none (a public EAGLE-3 checkpoint)."""
        return read_json(Path(directory) / RECORD)

    @staticmethod
    def record_spec(record: dict[str, Any] | None) -> DrafterSpec | None:
        """The DrafterSpec a record names, or None when there is no record or it holds no spec."""
        if not record or not record.get("spec"):
            return None
        return DrafterSpec.from_dict(record["spec"])
