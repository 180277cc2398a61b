"""``docfuse kv-store list|clear|prune``: the prefilled documents ``docfuse ask`` keeps (runtime.kv_store).

It joins ``docfuse`` through the ``docfuse.commands`` entry point (pipelines.commands), beside the store it manages.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

app = typer.Typer(add_completion=False)


@app.command("kv-store")
def kv_store(action: Annotated[Literal["list", "clear", "prune"], typer.Argument(help="list the entries, clear them "
                                                                                       "all, or prune to --max-gb")],
             folder: Annotated[Path, typer.Option(help="The store (docfuse ask keeps it in <cache-dir>/kv).")]
             = Path(".docfuse-cache/kv"),
             max_gb: Annotated[float, typer.Option(help="prune: keep at most this many gigabytes.")] = 20.0) -> None:
    """The KV store: documents whose prefill a later question skips."""
    from docfuse.runtime.kv_store import KVStore

    store = KVStore(folder, int(max_gb * 1e9))
    if action == "list":
        entries = store.entries()
        for e in entries:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)) if e.last_used else "-"
            typer.echo(f"{e.path.name[:16]}  {e.tokens:>7} tokens  {e.nbytes / 1e6:>8.1f} MB  last used {when}"
                       f"  {e.source}")
        typer.echo(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
                   f"{sum(e.nbytes for e in entries) / 1e6:.1f} MB in {folder}")
        return
    gone, freed = store.clear() if action == "clear" else store.prune()
    typer.echo(f"removed {gone} entr{'y' if gone == 1 else 'ies'}, {freed / 1e6:.1f} MB, from {folder}")
