"""docfuse's engine: pipeline specs, validation, the DAG, executors, Arrow I/O, the stage cache, the CLI."""

from docfuse.pipelines.pipeline import Pipeline, RowErrors, RowErrorsWarning
from docfuse.pipelines.spec import PipelineSpec, StageSpec
from docfuse.pipelines.stage import Stage, StageParams, error_value

__all__ = ["Pipeline", "PipelineSpec", "RowErrors", "RowErrorsWarning", "StageSpec", "Stage", "StageParams",
           "error_value"]
