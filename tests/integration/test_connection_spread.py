"""Keep-alive connections spread over the shim's gunicorn workers (app/gunicorn_worker.py): plain gthread let
the first worker awake take all sixteen of a load generator's connections, so one GIL did all the work."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from devstack.launch import ServedApp
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
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the shim closed the connection before answering"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the shim closed the connection in the middle of an answer"
        body += chunk
    return int(lines[0].split()[1]), headers.get("connection", "").lower() == "close"


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
