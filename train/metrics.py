"""Training metrics: exact cross-rank reduction, a local jsonl log, optional Weights & Biases (the
per-step accuracies and the AL estimate they feed are models/alignment.py's).

Every ratio metric travels as a (numerator, denominator) pair and is summed over micro-batches and
ranks before dividing, so a rank with more masked tokens weighs more, exactly as one big batch would.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from fledge.conf.schema import LoggingConfig
from fledge.distributed import all_reduce_sum

log = logging.getLogger(__name__)


class RatioMeter:
    """Sums (numerator, denominator) pairs per name; ``reduce()`` divides after an all-reduce."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for name, (num, den) in metrics.items():
            # The sums stay on the metrics' device (no host sync per micro-batch); reduce() hands them to
            # all_reduce_sum, which runs the collective on the process group's device.
            den = torch.as_tensor(den, device=num.device)
            pair = torch.stack([num.detach().double().sum(), den.detach().double().sum()])
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def reduce(self) -> dict[str, float]:
        """All ranks must call this together (same names in the same order)."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        total = all_reduce_sum(torch.stack([self.sums[n] for n in names]))
        self.sums = {}
        return {n: (float(num / den) if den > 0 else float("nan")) for n, (num, den) in zip(names, total.tolist())}


class MetricsLog:
    """Rank 0 only: appends one JSON object per logged step; mirrors to wandb when ``logging`` (a
    ``LoggingConfig``) names a project. ``run_name`` names the wandb run (unless ``wandb_run_name`` is set)
    and ``run_config`` is what wandb records as the run's config."""

    def __init__(self, path: Path, resume_step: int, logging: LoggingConfig, run_name: str,
                 run_config: dict[str, Any] | None = None) -> None:
        self.path = path
        self._truncate_after(resume_step)
        self.wandb = _start_wandb(logging, run_name, run_config or {}, path.parent)

    def _truncate_after(self, step: int) -> None:
        # A resumed run re-logs the steps after its checkpoint: drop the killed run's later lines.
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is untrusted
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        # A ratio with no counted rows in the window (or a non-finite value) is null: strict JSON, and
        # "no value" rather than a number; wandb just skips it.
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
            except Exception as e:  # never let logging take training down
                log.warning("wandb.log failed (%s); continuing without wandb", e)
                self.wandb = None

    def close(self) -> None:
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass


def _start_wandb(lc: LoggingConfig, run_name: str, run_config: dict[str, Any], run_dir: Path):
    if not lc.wandb_project or lc.wandb_mode == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return None
    mode = lc.wandb_mode
    if mode == "auto":
        has_key = bool(os.environ.get("WANDB_API_KEY")) or Path.home().joinpath(".netrc").exists()
        mode = "online" if has_key else "offline"
    try:
        import wandb

        return wandb.init(
            project=lc.wandb_project, name=lc.wandb_run_name or run_name, tags=list(lc.wandb_tags),
            mode=mode, dir=str(run_dir), resume="allow", id=f"{run_name}-train", config=run_config,
        )
    except Exception as e:
        log.warning("wandb could not start (%s); training continues with the local metrics log only", e)
        return None
