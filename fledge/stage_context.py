"""What a pipeline stage receives (the runner, fledge/pipeline/runner.py, builds one per stage): its job.

Its own module below the pipeline because the stages' work lives in the layers under it, which must not import
the pipeline that calls them.

A stage sees the run config only as its inputs: the frozen dataclass of fledge/stage_inputs.py its record builds
(pipeline/stages.py), holding exactly what its library reads; the runner hashes that dataclass's hashed fields,
so what is hashed is what the stage is given. The stage hands its library the inputs (or their fields), never
the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from fledge.distributed import World
from fledge.run_layout import RunLayout

Inputs = TypeVar("Inputs")


@dataclass
class StageContext(Generic[Inputs]):
    """What a stage receives: its inputs (``StageContext[TrainInputs]`` for the train stage), the world, the
    run's layout and the upstream manifests."""

    inputs: Inputs
    world: World
    layout: RunLayout
    stage: str  # this stage's name
    upstream: dict[str, dict]  # stage name -> its complete manifest (all earlier stages present)

    @property
    def stage_dir(self) -> Path:
        """This stage's directory (``layout.stage(stage)``)."""
        return self.layout.stage(self.stage)
