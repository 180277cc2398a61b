"""Calibration text anyone can regenerate: the docstrings of a fixed list of Python standard-library modules.

The shipped head is calibrated on this (PSF-licensed, on every machine with Python 3.11), never on the workspace
corpus, whose licences forbid shipping anything derived from it. Held-out fidelity is measured on other text.

    python -m docfuse.runtime.pruning.calibration_text > calibration.txt
"""

from __future__ import annotations

import importlib
import inspect
import sys

MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
           "datetime", "decimal", "email", "functools", "http.client", "importlib", "inspect", "itertools", "json",
           "logging", "multiprocessing", "os", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3", "ssl",
           "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest", "urllib.request",
           "uuid", "zipfile", "zoneinfo")


def _prose(doc: str) -> bool:
    """Keep paragraphs that read as sentences, not signatures or code listings."""
    words = doc.split()
    return len(words) >= 12 and sum(w.isalpha() for w in words) / len(words) > 0.6


def calibration_text(modules: tuple[str, ...] = MODULES) -> str:
    """Module, class and function docstrings of ``modules``, in a fixed order, one paragraph per docstring."""
    seen: set[str] = set()
    parts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        members = [module] + [obj for _, obj in sorted(vars(module).items())
                              if not _.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))]
        for obj in members:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen and _prose(doc):
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(calibration_text())
