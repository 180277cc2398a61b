"""What every ``docfuse`` command shares: the stderr console, the exit codes, and how a usage error ends a command.

Why apart from cli.py: the commands that other packages mount into ``docfuse`` (pipelines.commands) report their
errors the same way, without importing the engine's command module.
"""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

#: The exit code of a usage or validation error (3, some rows failed, is RunReport.exit_code's).
USAGE = 2

err = Console(stderr=True)


def fail(message: str) -> NoReturn:
    """Print ``message`` (which should name the fix) as an error and end the command with exit code 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # messages may hold [brackets]
    raise typer.Exit(USAGE)
