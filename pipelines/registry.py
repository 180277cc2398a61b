"""Stage kinds by name.

The engine knows no stage library: libraries announce themselves through the ``docfuse.stages`` entry-point
group (docfuse's own ``stages`` package does so in pyproject.toml), and each module registers its classes with
``@register``. Tests and users may register their own stage classes the same way.
"""

from __future__ import annotations

import difflib
from importlib.metadata import entry_points

from docfuse.pipelines.stage import Stage

_REGISTRY: dict[str, type[Stage]] = {}
_loaded = False


def register(cls: type[Stage]) -> type[Stage]:
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no `kind`; set kind = 'library.name'")
    _REGISTRY[cls.kind] = cls
    return cls


def _load_libraries() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in entry_points(group="docfuse.stages"):
        ep.load()


def all_stages() -> dict[str, type[Stage]]:
    _load_libraries()
    return dict(sorted(_REGISTRY.items()))


def find_stage(kind: str) -> type[Stage] | None:
    return all_stages().get(kind)


def suggest(kind: str) -> str:
    close = difflib.get_close_matches(kind, list(all_stages()), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else "run `docfuse stages` to list the kinds"
