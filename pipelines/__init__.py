"""docfuse's engine: pipeline specs, validation, the DAG, executors, Arrow I/O, the stage cache, the CLI."""

from importlib import import_module
from typing import Any

_HOME = {"Pipeline": "pipeline", "RowErrors": "pipeline", "RowErrorsWarning": "pipeline", "PipelineSpec": "spec",
         "StageSpec": "spec", "Stage": "stage", "StageParams": "stage", "error_value": "stage"}

__all__ = ["Pipeline", "PipelineSpec", "RowErrors", "RowErrorsWarning", "StageSpec", "Stage", "StageParams",
           "error_value"]


def __getattr__(name: str) -> Any:
    """Each name imported from its module on first use, so that importing a light module of this package (the
    ``docfuse`` launcher) does not import pyarrow and the engine."""
    if name in _HOME:
        return getattr(import_module(f"docfuse.pipelines.{_HOME[name]}"), name)
    raise AttributeError(f"module 'docfuse.pipelines' has no attribute {name!r}")
