"""Live progress from inside a stage, for a caller that shows it (``docfuse ask`` on a terminal).

The engine knows nothing of models, so the hooks are plain callbacks in a ContextVar: the caller sets :data:`LIVE`,
and a stage that works for a while (``decode.generate``: the document's prefill in tokens, the answer as it is
decoded) reports through it; the executor says which stage starts (a model's load or a scan's OCR is otherwise a
silent wait). Only the local executor runs stages in the caller's context; elsewhere nothing is shown.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class Live:
    on_prefill: Callable[[int, int], None] | None = None  # (tokens done, tokens in all)
    on_text: Callable[[str], None] | None = None  # the answer's text added by its newest token
    on_stage: Callable[[str, str], None] | None = None  # (stage name, stage kind) as it starts on a batch


LIVE: ContextVar[Live | None] = ContextVar("docfuse_live_progress", default=None)
