"""docfuse: declarative pipelines that turn long documents into answers.

The public API. The engine, stages, runtime and fusion live in the repository's top-level folders and install as
``docfuse.pipelines``, ``docfuse.stages``, ``docfuse.runtime`` and ``docfuse.fusion``, so no generic top-level name
lands on a user's import path::

    from docfuse import Pipeline
    report = Pipeline.from_yaml("pdf_qa").set("params.question", "Who signed?").run(["contract.pdf"])
"""

from typing import Any

__all__ = ["Pipeline", "PipelineSpec", "RowErrors", "RowErrorsWarning", "StageSpec", "Stage", "StageParams",
           "error_value"]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use: ``docfuse ask`` handing its question to a running ``docfuse serve``
    (pipelines.launcher) must not pay for pyarrow and the engine (about a second on two cores)."""
    if name in __all__:
        import docfuse.pipelines as pipelines

        return getattr(pipelines, name)
    raise AttributeError(f"module 'docfuse' has no attribute {name!r}")
