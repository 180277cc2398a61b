"""docfuse's shipped data (the fusion checkpoint, the pruning head, the sample PDF), installed as package data.

Code finds these files through :func:`shipped`, never through paths relative to the source tree, so a wheel installed
anywhere finds them as a checkout does (issue 27).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def shipped(relative: str = "") -> Path:
    """The shipped file or folder ``relative`` to this package, e.g. ``shipped("pruning")``."""
    return Path(str(files(__name__).joinpath(relative))) if relative else Path(str(files(__name__)))
