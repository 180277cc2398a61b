"""Commands that other packages mount into ``docfuse``.

The engine's command line (cli.py) knows run, validate, stages and ask. Commands that train or calibrate models
live beside what they train and announce themselves through the ``docfuse.commands`` entry-point group, the way
stage libraries announce themselves through ``docfuse.stages`` (registry.py): each entry point names a
``typer.Typer`` whose commands join ``docfuse`` at the top level.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import typer

GROUP = "docfuse.commands"

#: docfuse's own command modules, as pyproject.toml declares them. An editable install made before an entry was
#: added to pyproject.toml keeps its old metadata until it is reinstalled (``make setup`` does it), and its group
#: lacks the entry; such entries are loaded from here instead, by the same name, so their commands never go missing.
BUILTIN = (EntryPoint("fusion", "docfuse.fusion.cli:app", GROUP),
           EntryPoint("pruning", "docfuse.runtime.pruning.cli:app", GROUP),
           EntryPoint("kv-store", "docfuse.runtime.kv_store_cli:app", GROUP))


def command_entry_points() -> list[EntryPoint]:
    """The group's entry points, plus each built-in one the installed metadata does not list."""
    found = list(entry_points(group=GROUP))
    names = {ep.name for ep in found}
    return found + [ep for ep in BUILTIN if ep.name not in names]


def mount(app: typer.Typer) -> None:
    """Add every announced command to ``app``; a name that is already taken is an error naming both owners."""
    taken = {_name(info) for info in app.registered_commands}
    for ep in command_entry_points():
        sub = ep.load()
        if not isinstance(sub, typer.Typer):
            raise TypeError(f"entry point '{ep.name} = {ep.value}' in group {GROUP} names a "
                            f"{type(sub).__name__}; it must name a typer.Typer holding the commands")
        for info in sub.registered_commands:
            name = _name(info)
            if name in taken:
                raise ValueError(f"command '{name}' from entry point '{ep.name} = {ep.value}' is already a docfuse "
                                 "command; rename one of them")
            taken.add(name)
        app.add_typer(sub)


def _name(info: typer.models.CommandInfo) -> str:
    """The command's name as typer shows it: given, or the function's name with dashes."""
    return info.name or info.callback.__name__.replace("_", "-")
