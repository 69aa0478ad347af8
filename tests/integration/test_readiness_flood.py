"""A flood of /readyz while Triton hangs, under real gunicorn: /healthz keeps answering and at most one
thread per worker waits on Triton for readiness (seen from the Triton side: the requests it holds).

Between the shim and the session's Triton sits a TCP relay of the test's own; once the shim is ready it
stops relaying, as a SIGSTOPped Triton would: connections are accepted, requests read, nothing answered.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from devstack import EmbeddedTriton
from tests.conftest import start_shim
from tests.support import wait_until

pytestmark = pytest.mark.triton
WORKERS = 2
FLOODERS = 40


class HangingRelay:
    """Relays TCP to `upstream` until `hang` is set; then holds whatever requests come, and counts them."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.hang = threading.Event()
        self.held: set[socket.socket] = set()  # connections whose last request is unanswered while hanging
        self.most_held = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        self._sockets.append(upstream)
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        holding = False
        try:
            while data := client.recv(65536):
                if not self.hang.is_set():
                    upstream.sendall(data)
                elif not holding:
                    holding = True
                    with self._lock:
                        # The kernel knows at once when the shim closed a connection (its FIN is queued),
                        # even if that connection's own thread has not run since: those no longer wait.
                        self.held = {c for c in self.held if not _closed_by_peer(c)} | {client}
                        self.most_held = max(self.most_held, len(self.held))
        except OSError:
            pass
        finally:
            if holding:  # the shim gave up on it and closed the connection
                with self._lock:
                    self.held.discard(client)
            for s in (client, upstream):
                s.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()


def _closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing more sent
    except OSError:
        return True


@pytest.fixture
def relay(triton: EmbeddedTriton) -> Iterator[HangingRelay]:
    made = HangingRelay((triton.config.host, triton.config.http_port))
    yield made
    made.close()


def test_a_readyz_flood_against_a_hung_triton_keeps_healthz_answering_and_one_check_per_worker(
        relay: HangingRelay, test_repo: Path, test_model_pt: Path, tmp_path: Path) -> None:
    shim = start_shim(tmp_path, triton_url=f"127.0.0.1:{relay.port}", repo=test_repo, model_pt=test_model_pt,
                      mode="triton", transport="fp32", workers=WORKERS, max_pending=8)
    stop = threading.Event()
    answers: list[int] = []
    ages: list[float] = []
    try:
        shim.wait("/readyz")
        for _ in range(8):  # both workers have settled their transport while Triton answers
            assert requests.get(shim.url + "/readyz", timeout=30).status_code == 200
        relay.hang.set()

        def flood() -> None:
            with requests.Session() as session:
                while not stop.is_set():
                    try:
                        answer = session.get(shim.url + "/readyz", timeout=30)
                    except requests.RequestException:
                        continue
                    answers.append(answer.status_code)
                    ages.append(answer.json()["backends"]["triton"]["age_s"])

        flooders = [threading.Thread(target=flood) for _ in range(FLOODERS)]
        for thread in flooders:
            thread.start()
        wait_until(lambda: len(answers) >= 200 and relay.most_held > 0, 60, "the flood to get going")
        health = [requests.get(shim.url + "/healthz", timeout=10).status_code for _ in range(10)]
        wait_until(lambda: len(answers) >= 400, 60, "more of the flood")
    finally:
        stop.set()
        for thread in locals().get("flooders", []):
            thread.join(timeout=60)
        relay.hang.clear()
        shim.stop(graceful=False)
    assert health == [200] * 10
    assert relay.most_held <= WORKERS, f"{relay.most_held} readiness calls waited on Triton at once"
    assert set(answers) == {200, 503} or set(answers) == {503}, set(answers)
    assert any(age > 0 for age in ages), "answers given while another thread checked carry their age"
