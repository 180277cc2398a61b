"""docfuse: declarative pipelines that turn long documents into answers.

The public API. The engine, stages, runtime and fusion live in the repository's top-level folders and install as
``docfuse.pipelines``, ``docfuse.stages``, ``docfuse.runtime`` and ``docfuse.fusion``, so no generic top-level name
lands on a user's import path::

    from docfuse import Pipeline
    report = Pipeline.from_yaml("pdf_qa").set("params.question", "Who signed?").run(["contract.pdf"])
"""

from docfuse.pipelines import (Pipeline, PipelineSpec, RowErrors, RowErrorsWarning, Stage, StageParams, StageSpec,
                               error_value)

__all__ = ["Pipeline", "PipelineSpec", "RowErrors", "RowErrorsWarning", "StageSpec", "Stage", "StageParams",
           "error_value"]
