"""The public ``Pipeline``: the spec (spec.py) that can also check and run itself.

Why a subclass in its own module: spec.py stays pure data that validation and the executors import; this module
sits above all of them, so nothing imports in a circle.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pyarrow as pa

from docfuse.pipelines.engines import choose_executor
from docfuse.pipelines.executor import RunReport
from docfuse.pipelines.spec import PipelineSpec
from docfuse.pipelines.validate import validate


class Pipeline(PipelineSpec):
    """A named DAG of stages (see PipelineSpec) with ``validate()`` and ``run()``."""

    def validate(self) -> list[str]:
        """Every problem, each with its fix; empty when the pipeline can run."""
        return validate(self)

    def run(self, inputs: Sequence[str | os.PathLike] | pa.Table, output: str | Path | None = None, *,
            engine: str = "local", cache_dir: str | Path | None = None, batch_docs: int = 8,
            column: str | None = None, address: str | None = None,
            errors: Literal["warn", "raise", "ignore"] = "warn") -> RunReport:
        """Run over ``inputs`` (paths, globs, folders, datasets, or a SOURCE table) and return a RunReport.

        With ``output`` the tables go to Parquet there; without, ``report.tables`` holds them. ``engine="ray"``
        runs on Ray Data (``pip install 'docfuse[ray]'``): on the Ray cluster at ``address``, else on the Ray
        this process already joined, else on a local Ray it starts, sized to this machine.
        """
        if errors not in ("warn", "raise", "ignore"):
            raise ValueError(f"errors={errors!r}: use 'warn' (the default), 'raise' or 'ignore'")
        executor = choose_executor(self, engine, cache_dir=cache_dir, address=address)
        report = executor.run(inputs, output, batch_docs=batch_docs, column=column)
        if report.error_rows and errors == "raise":
            raise RowErrors(report)
        if report.error_rows and errors == "warn":
            warnings.warn(f"{report.errors_summary()}; each row's 'error' column says why (errors='ignore' "
                          "silences this, errors='raise' raises)", RowErrorsWarning, stacklevel=2)
        return report


class RowErrorsWarning(UserWarning):
    """Some rows of a run carry an error (``Pipeline.run(errors="warn")``, the default)."""


class RowErrors(RuntimeError):
    """Some rows of a run carry an error (``Pipeline.run(errors="raise")``); ``report`` has every table."""

    def __init__(self, report: RunReport) -> None:
        self.report = report
        super().__init__(f"{report.errors_summary()}; each row's 'error' column says why")
