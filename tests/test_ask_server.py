"""``docfuse serve`` answers ``docfuse ask`` as a lone process would: same answer row, output and exit code; a client
never waits on a dead, foreign or busy-elsewhere socket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docfuse.pipelines import ask_server, cli, launcher

DOCFUSE = Path(sys.executable).parent / "docfuse"
DOCUMENT = ("Service Agreement\n\nThe Provider is Calder Freight GmbH of Hamburg. The Client pays a monthly fee of "
            "4,250 euros on the first Business Day of each month. Either party may end this agreement with three "
            "months' notice. This agreement is governed by the laws of Ireland.\n")


def _exchange(tmp_path: Path, request: dict) -> list[dict]:
    """Serve one request in this process over a socket pair; the messages the client receives."""
    client, server = socket.socketpair()
    with client, server:
        client.sendall(json.dumps(request).encode() + b"\n")
        ask_server._answer(server, cli.app)
        server.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.decode().splitlines()]


def test_a_request_runs_ask_in_the_clients_folder_with_its_output_and_exit_code(tmp_path) -> None:
    messages = _exchange(tmp_path, {"argv": ["ask", "missing.pdf", "Who signed?"], "cwd": str(tmp_path),
                                    "version": ask_server.installed_version(), "tty_out": False, "tty_err": False})
    assert messages[-1] == {"exit": 3}  # an error row, as a lone run gives
    said = "".join(m.get("e", "") for m in messages)
    assert "missing.pdf" in said and "\x1b[" not in said  # the client's stderr is no terminal: no colour codes
    assert os.getcwd() != str(tmp_path)  # the server's own folder is restored


@pytest.mark.parametrize("change", [{"version": "0.0.0-other"}, {"argv": ["run", "pdf_qa", "-i", "x.pdf"]}])
def test_another_version_or_another_command_is_refused_so_the_client_runs_it_alone(tmp_path, change) -> None:
    request = {"argv": ["ask", "x.pdf", "q"], "cwd": str(tmp_path), "version": ask_server.installed_version(),
               "tty_out": False, "tty_err": False, **change}
    assert list(_exchange(tmp_path, request)[-1]) == ["refused"]


def test_a_client_without_a_live_server_answers_none_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DOCFUSE_SERVER_SOCKET", str(tmp_path / "ask.sock"))
    monkeypatch.delenv("DOCFUSE_SERVER")
    assert launcher.ask_through_server(["ask", "x.pdf", "q"]) is None  # no socket file
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "ask.sock"))  # a file left by a server that died: nobody listens
    dead.close()
    t0 = time.perf_counter()
    assert launcher.ask_through_server(["ask", "x.pdf", "q"]) is None
    assert time.perf_counter() - t0 < ask_server.CONNECT_TIMEOUT_S
    listening = ask_server._listen(tmp_path / "ask.sock")  # serve replaces the dead file
    with listening, pytest.raises(RuntimeError, match="already listens"):
        ask_server._listen(tmp_path / "ask.sock")
    assert (tmp_path / "ask.sock").stat().st_mode & 0o777 == 0o600


@pytest.mark.slow  # the real model, in a server process and a lone one
def test_served_answers_equal_lone_answers_through_the_console_command(tmp_path) -> None:
    doc = tmp_path / "agreement.txt"
    doc.write_text(DOCUMENT)
    sock = tmp_path / "ask.sock"
    served = {k: v for k, v in os.environ.items() if k != "DOCFUSE_SERVER"} | {"DOCFUSE_SERVER_SOCKET": str(sock)}
    alone = {**os.environ, "DOCFUSE_SERVER": "0"}
    server = subprocess.Popen([str(DOCFUSE), "serve", "--idle-minutes", "5"], env=served, cwd=tmp_path,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert "listening" in server.stderr.readline()
        ask = [str(DOCFUSE), "ask", doc.name, "What is the monthly fee?", "--json", "--max-new-tokens", "12"]
        one = subprocess.run([*ask, "--cache-dir", "c1"], env=served, cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        two = subprocess.run([*ask, "--cache-dir", "c2"], env=alone, cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        bad = subprocess.run([str(DOCFUSE), "ask", "nowhere.pdf", "q"], env=served, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    finally:
        stopped = subprocess.run([str(DOCFUSE), "serve", "--stop"], env=served, capture_output=True, text=True,
                                 timeout=120)
        log = server.communicate(timeout=60)[1]
    assert stopped.returncode == 0 and "stopped" in stopped.stderr and server.returncode == 0
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr
    served_row, lone_row = json.loads(one.stdout.splitlines()[-1]), json.loads(two.stdout.splitlines()[-1])
    assert "4,250" in served_row["answer"]
    assert served_row["answer"] == lone_row["answer"] and served_row["prompt_tokens"] == lone_row["prompt_tokens"]
    assert (tmp_path / "c1").is_dir()  # the stage cache went where the client's folder put it
    assert bad.returncode == 3 and "nowhere.pdf" in bad.stderr
    assert log.count("docfuse server: ask ") == 2  # both questions went through the server
    assert not sock.exists()


def test_serve_stops_when_asked_or_killed_and_removes_its_socket(tmp_path, monkeypatch) -> None:
    import signal
    import threading

    monkeypatch.setenv("DOCFUSE_SERVER_SOCKET", str(tmp_path / "a.sock"))
    assert not ask_server.stop()  # nobody to stop
    thread = threading.Thread(target=ask_server.serve, args=(cli.app, 1.0))
    thread.start()
    deadline = time.time() + 30
    while not (tmp_path / "a.sock").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ask_server.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and not (tmp_path / "a.sock").exists()

    env = {**os.environ, "DOCFUSE_SERVER_SOCKET": str(tmp_path / "b.sock")}
    code = "from docfuse.pipelines import ask_server, cli; ask_server.serve(cli.app, 1.0)"
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    assert "listening" in server.stderr.readline()
    server.send_signal(signal.SIGTERM)  # `kill`: cleaned up like Ctrl-C
    server.wait(timeout=60)
    assert server.returncode == 0 and not (tmp_path / "b.sock").exists()
