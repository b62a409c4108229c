"""What each pipeline stage's library receives: one frozen dataclass per stage, holding exactly what it reads.

pipeline/stages.py builds them from the run config; the runner hashes them (fields marked runtime stay out of the
hash). The libraries below the pipeline (data/, train/, evaluation/, serving/) take these, never the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass

from fledge.conf.schema import (
    CaptureConfig,
    DataConfig,
    DeepSpeedConfig,
    DrafterConfig,
    EvalConfig,
    ExportConfig,
    LoggingConfig,
    TargetConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class PrepareInputs:
    data: DataConfig
    target: TargetConfig
    draft_vocab_size: int
    seed: int


@dataclass(frozen=True)
class CaptureInputs:
    target: TargetConfig
    capture: CaptureConfig
    aux_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class TrainInputs:
    drafter: DrafterConfig
    train: TrainConfig
    deepspeed: DeepSpeedConfig
    target: TargetConfig
    aux_layer_ids: tuple[int, ...]
    seed: int
    capture: CaptureConfig
    logging: LoggingConfig
    run_name: str
    recipe: str


@dataclass(frozen=True)
class ExportInputs:
    export: ExportConfig
    target: TargetConfig
    draft_tokens: int


@dataclass(frozen=True)
class EvalInputs:
    eval: EvalConfig
    target: TargetConfig
    chat_template: str | None
    ttt_steps: int
    algorithm: str
    block_size: int
    seed: int
    chunk_tokens: int


@dataclass(frozen=True)
class PublishInputs:
    export: ExportConfig
    target: TargetConfig
    draft_tokens: int
    stages: tuple[str, ...]
