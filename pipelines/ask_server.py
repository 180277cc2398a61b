"""``docfuse serve``: one process that keeps the model loaded and answers ``docfuse ask`` for its user's terminals.

A repeated question about a document is cheap once its KV cache is stored (issue 24), but every ``docfuse ask``
process still imports torch and transformers and loads the model: about 5-6 s of a second question's ~8 s on two
cores. The server pays that once. Clients (pipelines/launcher.py) send the command line, their working directory and
whether their stdout and stderr are terminals; the server runs the very ``ask`` command of pipelines/cli.py with
``sys.stdout``/``sys.stderr`` replaced by streams that forward each write, then sends the exit code. One question at
a time: others wait in the socket's queue. The server's own environment applies (``DOCFUSE_THREADS`` and the like);
output that native libraries write to file descriptors directly stays on the server's terminal.

The socket is ``$DOCFUSE_HOME/ask.sock``, mode 0600 (only its user can connect); the server takes no command other
than ``ask``, and leaves (removing the socket) after ``idle_minutes`` without a question, on Ctrl-C or SIGTERM, or
when ``docfuse serve --stop`` asks it to.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


#: The socket's name in docfuse's home (``$DOCFUSE_HOME``, default ``~/.cache/docfuse``).
SOCKET_NAME = "ask.sock"
#: Seconds a client waits for the server to accept before it runs the question itself.
CONNECT_TIMEOUT_S = 2.0


def socket_path() -> Path:
    """Where ``docfuse serve`` listens: one per user and docfuse home, whatever folder ``ask`` runs in
    (``DOCFUSE_SERVER_SOCKET`` names another file: a second server beside the first, or a test's own)."""
    if os.environ.get("DOCFUSE_SERVER_SOCKET"):
        return Path(os.environ["DOCFUSE_SERVER_SOCKET"]).expanduser()
    home = os.environ.get("DOCFUSE_HOME") or Path.home() / ".cache" / "docfuse"
    return Path(home).expanduser() / SOCKET_NAME


def installed_version() -> str:
    """The docfuse version a client and a server must share (a server left running across an upgrade is not used)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("docfuse")
    except PackageNotFoundError:
        return "source"


def connect(path: Path) -> socket.socket | None:
    """A connection to the server listening on ``path``, or None when nobody accepts within ``CONNECT_TIMEOUT_S``
    (no file, or a file left by a server that died). The connection has no timeout: a question takes as long as
    its prefill and answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    conn.settimeout(None)
    return conn


def send(wire: Any, message: dict[str, Any]) -> None:
    """One message of the protocol: a JSON object on its own line, flushed."""
    wire.write(json.dumps(message).encode() + b"\n")
    wire.flush()


class _Forward(io.TextIOBase):
    """A text stream whose writes go to the client as ``{key: text}`` lines; ``isatty`` is the client's answer, so
    ``ask`` streams tokens and progress exactly when the client's own stream is a terminal."""

    def __init__(self, wire: Any, key: str, tty: bool, lock: threading.Lock) -> None:
        self._wire, self._key, self._tty, self._lock = wire, key, tty, lock  # progress bars write from threads

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._tty

    def write(self, text: str | bytes) -> int:  # click's echo may hand over bytes
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if text:
            with self._lock:
                send(self._wire, {self._key: text})
        return len(text)


class _Stop(Exception):
    """A client asked the server to leave."""


def stop() -> bool:
    """Ask the running server to leave; False when none answers."""
    conn = connect(socket_path())
    if conn is None:
        return False
    with conn, conn.makefile("rwb") as wire:  # it finishes the question it is answering first
        send(wire, {"stop": True})
        return bool(wire.readline())


def _on_signals() -> None:
    """Ctrl-C, `kill` (SIGTERM) and a closed terminal (SIGHUP) end the server through its cleanup, which removes the
    socket file; SIGINT is handled even where a shell started the server in the background with SIGINT ignored."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)  # the terminal that started `docfuse serve &` closed
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _listen(path: Path) -> socket.socket:
    """Bind the socket, replacing a file left by a server that died; refuse if a live server answers there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        probe = connect(path)
        if probe is None:
            path.unlink()
        else:
            probe.close()
            raise RuntimeError(f"a docfuse server already listens on {path}; stop it (Ctrl-C where it runs) or use it")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(16)
    return server


def _answer(conn: socket.socket, app: Callable[..., Any]) -> None:
    """One client: read its request, run ``ask`` with its streams and folder, send the exit code."""
    from docfuse.pipelines import console

    with conn.makefile("rwb") as wire:
        line = wire.readline()
        if not line:
            return
        request = json.loads(line)
        if request.get("stop"):  # `docfuse serve --stop`
            send(wire, {"exit": 0})
            raise _Stop
        argv = list(request.get("argv") or [])
        if request.get("version") != installed_version() or argv[:1] != ["ask"]:
            send(wire, {"refused": "another docfuse version or command"})
            return
        saved = sys.stdout, sys.stderr, os.getcwd()
        code: Any = 1
        started = time.perf_counter()
        try:
            os.chdir(request["cwd"])
            lock = threading.Lock()
            sys.stdout = _Forward(wire, "o", bool(request.get("tty_out")), lock)
            sys.stderr = _Forward(wire, "e", bool(request.get("tty_err")), lock)
            # rich picks colours when a console is made: the shared one is made again, in place (every module holds
            # it by name), for this client's stderr, then for the server's
            console.err.__init__(stderr=True, force_terminal=bool(request.get("tty_err")))
            try:
                app(args=argv, prog_name="docfuse")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - the client sees the traceback a local run would print
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout, sys.stderr = saved[0], saved[1]
            console.err.__init__(stderr=True)
            os.chdir(saved[2])
        print(f"docfuse server: {' '.join(argv[:2])} ... exit {code} in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
        try:
            send(wire, {"exit": code})
        except OSError:
            pass  # the client left (Ctrl-C): nothing to tell it


def warm_up(pipe: Any) -> None:
    """Set up the stages the pipeline ``pipe`` runs, as ``ask`` will (the answer stage imports the decode stack and
    loads its model, which stays loaded for the process), so the first question is as quick as the later ones."""
    from docfuse.pipelines.planning import make_plan
    from docfuse.pipelines.validate import check

    pipeline = pipe.name
    checked = check(pipe)
    if checked.problems:
        raise RuntimeError(f"pipeline {pipeline!r} is invalid ({checked.problems[0]}); `docfuse validate {pipeline}` "
                           "lists every problem")
    for name in make_plan(pipe, checked.graph, checked.instances).order:
        checked.instances[name].setup()


def serve(app: Callable[..., Any], idle_minutes: float = 30.0, warm: Any = None) -> None:
    """Run ``app`` (the ``docfuse`` command line, handed over by its ``serve`` command) for each ``ask`` request
    until ``idle_minutes`` pass without one (0: never idle out); ``warm``: a pipeline to set up first."""
    path = socket_path()
    server = _listen(path)
    _on_signals()
    started = time.perf_counter()
    try:
        if warm is not None:
            warm_up(warm)
        print(f"docfuse server listening on {path} (ready in {time.perf_counter() - started:.1f} s); "
              f"`docfuse ask` from any folder now uses it. Ctrl-C stops it"
              + (f"; it stops by itself after {idle_minutes:g} min without a question." if idle_minutes else "."),
              file=sys.stderr, flush=True)
        server.settimeout(idle_minutes * 60 if idle_minutes else None)
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                print(f"docfuse server: {idle_minutes:g} min without a question; stopping", file=sys.stderr)
                return
            with conn:
                conn.settimeout(None)
                try:
                    _answer(conn, app)
                except _Stop:
                    print("docfuse server: asked to stop", file=sys.stderr)
                    return
                except (OSError, ValueError) as exc:  # a client that vanished or sent garbage: the next one is served
                    print(f"docfuse server: a request failed ({exc})", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        path.unlink(missing_ok=True)
