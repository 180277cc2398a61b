"""The ``docfuse`` console entry: hands ``docfuse ask`` to a running ``docfuse serve`` when there is one, else runs
the command in this process.

Why a module of its own: a ``docfuse ask`` that finds a server must not import torch, transformers or pyarrow (about
5 s on two cores, most of a repeated question's wall time); this module and ask_server's top level import only the
standard library. The server (pipelines/ask_server.py) runs the same ``ask`` command, so answers, exit codes and
output are the same.
``DOCFUSE_SERVER=0`` always runs here.
"""

from __future__ import annotations

import json
import os
import sys

from docfuse.pipelines.ask_server import connect, installed_version, send, socket_path


def ask_through_server(argv: list[str]) -> int | None:
    """Send ``docfuse ask ...`` (``argv`` without the program name) to the server and relay its output; the exit
    code, or None when no usable server answered (the caller then runs the command itself)."""
    if os.environ.get("DOCFUSE_SERVER") == "0" or not socket_path().exists():
        return None
    conn = connect(socket_path())  # None: a socket left by a server that died; `docfuse serve` replaces the file
    if conn is None:
        return None
    request = {"argv": argv, "cwd": os.getcwd(), "version": installed_version(),
               "tty_out": sys.stdout.isatty(), "tty_err": sys.stderr.isatty()}
    with conn, conn.makefile("rwb") as wire:
        send(wire, request)
        for line in wire:
            message = json.loads(line)
            if "o" in message:
                sys.stdout.write(message["o"])
                sys.stdout.flush()
            elif "e" in message:
                sys.stderr.write(message["e"])
                sys.stderr.flush()
            elif "refused" in message:
                return None
            elif "exit" in message:
                return int(message["exit"])
    return None  # the server went away mid-answer: nothing was decided, run here


def main() -> None:  # pragma: no cover - console entry, exercised through subprocesses in tests
    argv = sys.argv[1:]
    if argv[:1] == ["ask"] and not {"-h", "--help"} & set(argv):
        code = ask_through_server(argv)
        if code is not None:
            sys.exit(code)
    from docfuse.pipelines.cli import main as run_here

    run_here()
