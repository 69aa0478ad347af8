"""Keep-alive connections spread over the shim's gunicorn workers (app/gunicorn_worker.py): plain gthread let
the first worker awake take all sixteen of a load generator's connections, so one GIL did all the work."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from devstack.launch import ROOT, ServedApp, free_port
from tests.conftest import start_shim, stop_soon

if TYPE_CHECKING:
    from devstack import EmbeddedTriton

CLIENTS = 16


@pytest.fixture(scope="module")
def two_workers(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """A shim of its own (2 workers): no other test's kept-alive connections in the counts."""
    served = start_shim(tmp_path_factory.mktemp("shim-spread"), triton_url=triton.http_url, repo=test_repo,
                        model_pt=test_model_pt, mode="triton", workers=2)
    yield served.wait("/healthz")  # one worker up: the other may still be booting, as after a restart
    stop_soon(served)


def get(sock: socket.socket, port: int) -> tuple[int, bool]:
    """One keep-alive GET /healthz on `sock`: (status, whether the server asked to close)."""
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    status, close, _ = answer_of(sock)
    return status, close


def answer_of(sock: socket.socket) -> tuple[int, bool, str]:
    """One answer read from `sock`: (status, whether the server asked to close, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection before answering"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection in the middle of an answer"
        body += chunk
    return int(lines[0].split()[1]), headers.get("connection", "").lower() == "close", body.decode()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def held_by_worker(served: ServedApp, client_ports: set[int]) -> Counter[int]:
    """How many of these client connections each worker of the shim holds (the accepted socket's owner)."""
    held: Counter[int] = Counter()
    for worker in psutil.Process(served.process.pid).children():
        for conn in worker.net_connections(kind="tcp"):
            if (conn.status == psutil.CONN_ESTABLISHED and conn.laddr.port == served.port
                    and conn.raddr and conn.raddr.port in client_ports):
                held[worker.pid] += 1
    return held


def test_sixteen_clients_opened_at_once_end_up_spread_over_both_workers(two_workers: ServedApp) -> None:
    socks = [connect(two_workers.port) for _ in range(CLIENTS)]  # all at once, as a load generator opens them
    moved = 0
    try:
        deadline = time.monotonic() + 30
        while True:
            for i, sock in enumerate(socks):  # each client keeps asking, reconnecting when told to close
                status, close = get(sock, two_workers.port)
                assert status == 200  # an answer that moves the client is still a whole answer
                if close:
                    sock.close()
                    socks[i] = connect(two_workers.port)
                    moved += 1
            held = held_by_worker(two_workers, {s.getsockname()[1] for s in socks})
            # Even as the workers count it (app/gunicorn_worker.py should_move): 9 / 7 still moves one client.
            if sorted(held.values()) == [CLIENTS // 2] * 2:
                break
            assert time.monotonic() < deadline, f"connections per worker after 30 s: {dict(held)}"
        # Once even, nobody is moved again: a second round of every client closes nothing.
        assert not any(get(sock, two_workers.port)[1] for sock in socks), f"moved {moved}, then again"
        assert sum(held_by_worker(two_workers, {s.getsockname()[1] for s in socks}).values()) == CLIENTS
    finally:
        for sock in socks:
            sock.close()


# A plain WSGI app under real gunicorn with the shim's worker class: its second worker waits for a file before
# it starts taking connections (as one still importing torch does), and /slow answers once another file exists.
PROBE_APP = '''
import os, time

def app(environ, start_response):
    if environ["PATH_INFO"] == "/slow":
        while not os.path.exists(os.environ["PROBE_ANSWER"]):
            time.sleep(0.01)
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]
'''
PROBE_CONF = '''
import os, time
from app.gunicorn_worker import Spread

worker_class = "app.gunicorn_worker.BalancedThreadWorker"
workers, threads, keepalive, timeout = 2, 24, 60, 120
_spread = Spread(4)

def pre_fork(server, worker):
    _spread.assign(worker)

def child_exit(server, worker):
    _spread.release(worker)

def post_worker_init(worker):
    while worker.age == 2 and not os.path.exists(os.environ["PROBE_SECOND_UP"]):
        time.sleep(0.01)
'''


def test_requests_begun_before_the_second_worker_was_up_move_with_their_own_answer(tmp_path: Path) -> None:
    """A worker that took all sixteen connections alone tells clients to move in the answers to the requests they
    had sent before the other worker was up: a cycle sooner than with their next requests (3.8 s on a CPU)."""
    (tmp_path / "spread_probe.py").write_text(PROBE_APP)
    (tmp_path / "probe_conf.py").write_text(PROBE_CONF)
    second_up, answer = tmp_path / "second-up", tmp_path / "answer"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "PROBE_SECOND_UP": str(second_up),
           "PROBE_ANSWER": str(answer)}
    port = free_port()
    served = ServedApp("spread-probe", [sys.executable, "-m", "gunicorn", "-c", str(tmp_path / "probe_conf.py"),
                                        "--bind", f"127.0.0.1:{port}", "spread_probe:app"],
                       env, port, tmp_path / "gunicorn.log", cwd=tmp_path)
    socks: list[socket.socket] = []
    try:
        served.wait("/", timeout_s=60)  # the first worker; the second waits for `second_up`
        socks = [connect(port) for _ in range(CLIENTS)]
        for sock in socks:
            sock.sendall(f"GET /slow HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        ports = {s.getsockname()[1] for s in socks}
        deadline = time.monotonic() + 30
        while sorted(held_by_worker(served, ports).values()) != [CLIENTS]:
            assert time.monotonic() < deadline, f"held: {dict(held_by_worker(served, ports))}"
            time.sleep(0.05)
        first_pid = next(iter(held_by_worker(served, ports)))

        second_up.touch()
        while True:  # until a new connection is taken by the second worker: it is up and counts its connections
            with connect(port) as probe:
                probe.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
                if int(answer_of(probe)[2]) != first_pid:
                    break
            assert time.monotonic() < deadline, "the second worker never took a connection"
            time.sleep(0.05)

        answer.touch()
        answers = [answer_of(sock) for sock in socks]
        assert all(status == 200 for status, _, _ in answers)
        told = sum(close for _, close, _ in answers)
        # 16 / 0 moves eight (app/gunicorn_worker.py should_move); more would only swap the counts.
        assert 1 <= told <= CLIENTS // 2, f"{told} of {CLIENTS} first answers said `Connection: close`"
    finally:
        for sock in socks:
            sock.close()
        served.stop()
