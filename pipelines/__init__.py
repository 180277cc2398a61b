"""docfuse's engine: pipeline specs, validation, the DAG, executors, Arrow I/O, the stage cache, the CLI."""

from pipelines.spec import Pipeline, StageSpec
from pipelines.stage import Stage, StageParams, error_value

__all__ = ["Pipeline", "StageSpec", "Stage", "StageParams", "error_value"]
