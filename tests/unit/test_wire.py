"""The infer call's own HTTP/1.1 connection (app/backends/triton/wire.py) against a scripted peer on loopback: how
it reads answers that come in pieces, reuses and reopens connections, and says what went wrong. The real Triton
path is tests/integration's."""

from __future__ import annotations

import collections
import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from tritonclient.utils import InferenceServerException

from app.backends.triton.client import Clients
from app.backends.triton.wire import Wire
from app.errors import BackendTimeout, BackendUnavailable

Action = Callable[[socket.socket], bool]  # what the peer does with one request; False: it closes the connection


def answer(status: int, body: bytes, piece: int = 0, extra: str = "") -> Action:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    data = head.encode() + body

    def act(conn: socket.socket) -> bool:
        for i in range(0, len(data), piece or len(data)):
            conn.sendall(data[i:i + (piece or len(data))])
        return True
    return act


def raw(data: bytes, keep: bool = False) -> Action:
    def act(conn: socket.socket) -> bool:
        conn.sendall(data)
        return keep
    return act


class Peer:
    """Answers each request it reads with the next scripted action; records every request body it read, and on
    which connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.actions: collections.deque[Action] = collections.deque()
        self.requests: list[tuple[int, bytes]] = []
        self.connections = 0
        self.wires: list[Wire | Clients] = []  # the test's own, closed after it
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn, self.connections), daemon=True).start()

    def _talk(self, conn: socket.socket, number: int) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                self.requests.append((number, body))
                if not self.actions.popleft()(conn):
                    return

    def close(self) -> None:
        for w in self.wires:
            w.close()
        self._stop = True
        self.listener.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


def wire(peer: Peer) -> Wire:
    w = Wire("127.0.0.1", peer.port, connect_timeout_s=2, network_timeout_s=5)
    peer.wires.append(w)
    return w


def test_an_answer_that_comes_in_pieces_is_read_whole_and_the_connection_is_kept(peer: Peer) -> None:
    body = bytes(range(256)) * 40
    peer.actions.extend([answer(200, body, piece=7),
                         answer(200, b"second", extra="Inference-Header-Content-Length: 3\r\n")])
    w = wire(peer)
    assert w.post("/v2/models/m/infer", b"one", {})[1] == body
    headers, data = w.post("/v2/models/m/infer", b"two", {"Inference-Header-Content-Length": "3"})
    assert data == b"second" and headers["inference-header-content-length"] == "3"
    assert peer.requests == [(1, b"one"), (1, b"two")] and peer.connections == 1


def test_a_large_request_arrives_whole(peer: Peer) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: more than one send takes
    peer.actions.append(answer(200, b"{}"))
    wire(peer).post("/v2/models/m/infer", body, {})
    assert peer.requests == [(1, body)]


def test_a_kept_connection_the_server_closed_is_reopened_and_the_request_sent_once_on_it(peer: Peer) -> None:
    peer.actions.extend([raw(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"), answer(200, b"again")])
    w = wire(peer)
    assert w.post("/p", b"first", {})[1] == b"ok"  # the peer closes the connection after this answer
    assert w.post("/p", b"second", {})[1] == b"again"
    assert peer.requests == [(1, b"first"), (2, b"second")]


def test_a_new_connection_closed_before_answering_is_not_sent_again(peer: Peer) -> None:
    peer.actions.append(raw(b""))
    with pytest.raises(ConnectionError, match="before answering"):
        wire(peer).post("/p", b"once", {})
    assert peer.requests == [(1, b"once")]


def test_an_answer_cut_short_fails_and_is_not_sent_again(peer: Peer) -> None:
    peer.actions.extend([raw(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"), answer(200, b"unused")])
    with pytest.raises(ConnectionError, match="mid-answer"):
        wire(peer).post("/p", b"x", {})
    assert peer.requests == [(1, b"x")]


def test_an_answer_without_a_length_or_status_line_is_refused(peer: Peer) -> None:
    peer.actions.extend([raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", keep=True),
                         raw(b"SSH-2.0-OpenSSH\r\n\r\n")])
    w = wire(peer)
    with pytest.raises(ConnectionError, match="without a Content-Length"):
        w.post("/p", b"x", {})
    with pytest.raises(ConnectionError, match="no HTTP status line"):
        w.post("/p", b"y", {})
    assert peer.connections == 2  # a connection left in an unknown state is not used again


def test_an_error_answer_raises_tritonclients_exception_with_tritons_words(peer: Peer) -> None:
    peer.actions.extend([answer(400, json.dumps({"error": "unknown model: 'm'"}).encode()), answer(500, b"not json")])
    w = wire(peer)
    with pytest.raises(InferenceServerException) as e:
        w.post("/p", b"x", {})
    assert e.value.message() == "unknown model: 'm'" and e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="decoding the response"):
        w.post("/p", b"y", {})
    assert peer.connections == 1  # an error answer leaves the connection usable


def test_clients_translate_a_silent_server_and_a_closed_port(peer: Peer) -> None:
    peer.actions.append(lambda conn: conn.recv(1) is None)  # reads the request, then never answers
    silent = Clients(f"127.0.0.1:{peer.port}", connect_timeout_s=2, network_timeout_s=0.3)
    peer.wires.append(silent)
    with pytest.raises(BackendTimeout, match=r"did not answer within 0\.3 s"):
        silent.infer("m", [], outputs=[], where="Triton model 'm'")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    refused = Clients(f"127.0.0.1:{port}", connect_timeout_s=2, network_timeout_s=1)
    peer.wires.append(refused)
    with pytest.raises(BackendUnavailable, match="unreachable"):
        refused.infer("m", [], outputs=[], where="m")
