"""docfuse's engine: pipeline specs, validation, the DAG, executors, Arrow I/O, the stage cache, the CLI."""

from pipelines.pipeline import Pipeline
from pipelines.spec import PipelineSpec, StageSpec
from pipelines.stage import Stage, StageParams, error_value

__all__ = ["Pipeline", "PipelineSpec", "StageSpec", "Stage", "StageParams", "error_value"]
