"""Which executor runs a pipeline: the one choice that ``Pipeline.run`` and ``docfuse run`` share.

Why one function: the engine names, their defaults and their refusals must read the same from Python and from the
command line, so each error names both spellings of the fix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from docfuse.pipelines.executor import LocalExecutor
from docfuse.pipelines.executor_ray import RayExecutor

if TYPE_CHECKING:
    from docfuse.pipelines.spec import PipelineSpec

ENGINES = ("local", "ray")


def choose_executor(pipeline: PipelineSpec, engine: str = "local", *, cache_dir: str | os.PathLike | None = None,
                    address: str | None = None) -> LocalExecutor | RayExecutor:
    """The executor for ``engine``, built for ``pipeline``.

    Raises ValueError for an unknown engine or an ``address`` without Ray, PipelineInvalid when the pipeline has
    problems, RayUnavailable when Ray cannot be used.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine '{engine}' is not available; use engine='local' or engine='ray' "
                         "(on the command line: --engine local or --engine ray)")
    if address is not None and engine != "ray":
        raise ValueError("address names a Ray cluster, which only --engine ray uses (engine='ray' in Python); "
                         "leave the address out to run locally")
    if engine == "ray":
        return RayExecutor(pipeline, cache_dir=cache_dir, address=address)
    return LocalExecutor(pipeline, cache_dir=cache_dir)
