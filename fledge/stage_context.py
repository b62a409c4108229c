"""What a pipeline stage receives (the runner, fledge/pipeline/runner.py, builds one per stage).

Its own module below the pipeline because the stages' work lives in the layers under it: the train stage's
trainer (train/trainer.py) takes one, and it must not import the pipeline that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fledge.conf.schema import Config
from fledge.distributed import World
from fledge.run_layout import RunLayout


@dataclass
class StageContext:
    """What a stage receives: the typed config, the world, the run's layout and the upstream manifests."""

    cfg: Config
    world: World
    layout: RunLayout
    stage: str  # this stage's name
    upstream: dict[str, dict]  # stage name -> its complete manifest (all earlier stages present)

    @property
    def stage_dir(self) -> Path:
        """This stage's directory (``layout.stage(stage)``)."""
        return self.layout.stage(self.stage)
