"""The balanced gthread worker's decisions (app/gunicorn_worker.py): which worker takes a new connection, when
a kept-alive one moves, the master's slots, and when a thread serves its client's next request itself.
tests/integration/test_connection_spread.py runs it in gunicorn."""

from __future__ import annotations

import io
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from gunicorn.workers.gthread import ThreadWorker

from app.batching import triton_senders
from app.gunicorn_worker import DEFER_S, NOT_ACCEPTING, BalancedThreadWorker, Spread, should_move, should_wait


def test_a_new_connection_waits_for_a_worker_holding_fewer_but_never_past_the_deferral() -> None:
    assert should_wait(mine=3, fewest_elsewhere=2, waited_s=0.0)
    assert not should_wait(mine=2, fewest_elsewhere=2, waited_s=0.0)  # a tie: whoever is awake takes it
    assert not should_wait(mine=3, fewest_elsewhere=None, waited_s=0.0)  # no other worker accepts
    assert not should_wait(mine=9, fewest_elsewhere=0, waited_s=DEFER_S)  # the other is hung or busy: take it


def test_a_kept_alive_connection_moves_only_when_another_worker_holds_two_fewer() -> None:
    assert should_move(mine=9, fewest_elsewhere=7)
    assert should_move(mine=16, fewest_elsewhere=0)
    assert not should_move(mine=9, fewest_elsewhere=8)  # moving it would only swap the counts
    assert not should_move(mine=5, fewest_elsewhere=None)
    # Clients already told to go count as arrived elsewhere: 9 / 7 moves one, 16 / 0 moves eight.
    assert not should_move(mine=9, fewest_elsewhere=7, leaving=1)
    assert should_move(mine=16, fewest_elsewhere=0, leaving=7)
    assert not should_move(mine=16, fewest_elsewhere=0, leaving=8)


def test_the_master_hands_out_free_slots_and_a_dead_workers_slot_counts_for_nobody() -> None:
    spread = Spread(3)
    workers = [SimpleNamespace() for _ in range(3)]
    for w in workers:
        spread.assign(w)
    assert [w.spread[1] for w in workers] == [0, 1, 2]
    assert spread.fewest_elsewhere(0) is None  # no worker's loop runs yet: nobody accepts
    spread.counts[0], spread.counts[1], spread.counts[2] = 5, 2, 7
    assert spread.fewest_elsewhere(0) == 2
    spread.release(workers[1])
    assert spread.counts[1] == NOT_ACCEPTING and spread.fewest_elsewhere(0) == 7
    late = SimpleNamespace()
    spread.assign(late)  # the freed slot is reused
    assert late.spread[1] == 1
    over = SimpleNamespace()
    spread.assign(over)  # more workers than slots: it runs, unbalanced
    assert not hasattr(over, "spread")


def test_the_workers_together_keep_one_triton_request_per_model_instance_in_flight() -> None:
    assert triton_senders(instances=2, workers=2) == 1
    assert triton_senders(instances=2, workers=1) == 2
    assert triton_senders(instances=2, workers=4) == 1
    assert triton_senders(instances=3, workers=2) == 2


class Linger:
    """A BalancedThreadWorker around one connection (a socket pair), gthread's own handle() replaced by one that
    takes one byte (one request) and answers `keepalive`: what the loop around it does is what is tested."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, threads: int = 4, connections: int = 1) -> None:
        self.client, server = socket.socketpair()
        self.conn = SimpleNamespace(sock=server, parser=SimpleNamespace(unreader=SimpleNamespace(buf=io.BytesIO())))
        self.worker: Any = object.__new__(BalancedThreadWorker)
        self.worker.alive, self.worker.nr_conns = True, connections
        self.worker.cfg = SimpleNamespace(threads=threads)
        self.worker.linger_s = 0.02
        self.keepalive: bool = True
        self.served: list[bytes] = []

        def one_request(worker: Any, conn: Any) -> bool:
            buffered = conn.parser.unreader.buf.getvalue()
            conn.parser.unreader.buf = io.BytesIO(buffered[1:])
            self.served.append(buffered[:1] or conn.sock.recv(1))
            return self.keepalive

        monkeypatch.setattr(ThreadWorker, "handle", one_request)

    def close(self) -> None:
        self.client.close()
        self.conn.sock.close()


@pytest.fixture
def linger(monkeypatch: pytest.MonkeyPatch) -> Iterator[Linger]:
    made = Linger(monkeypatch)
    yield made
    made.close()


def test_a_thread_serves_the_requests_its_client_sends_next_then_hands_the_idle_client_back(linger: Linger) -> None:
    linger.client.sendall(b"abc")
    assert linger.worker.handle(linger.conn) is True  # kept alive: back to gthread's poller
    assert linger.served == [b"a", b"b", b"c"]


def test_bytes_already_read_ahead_are_a_next_request_too(linger: Linger) -> None:
    linger.client.sendall(b"a")
    linger.conn.parser.unreader.buf = io.BytesIO(b"b")  # gunicorn read past the first request's body
    linger.worker.handle(linger.conn)
    assert linger.served == [b"b", b"a"]


def test_an_answer_that_closes_the_connection_ends_it_even_with_a_request_waiting(linger: Linger) -> None:
    linger.keepalive = False
    linger.client.sendall(b"ab")
    assert linger.worker.handle(linger.conn) is False
    assert linger.served == [b"a"]


def test_a_stopping_worker_hands_the_connection_back(linger: Linger) -> None:
    linger.worker.alive = False
    linger.client.sendall(b"ab")
    linger.worker.handle(linger.conn)
    assert linger.served == [b"a"]


def test_no_thread_lingers_while_the_worker_holds_more_connections_than_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    crowded = Linger(monkeypatch, threads=4, connections=5)  # a lingering thread would keep another client waiting
    try:
        crowded.client.sendall(b"ab")
        assert crowded.worker.handle(crowded.conn) is True
        assert crowded.served == [b"a"]
    finally:
        crowded.close()


class Answer:
    """The part of gunicorn's Response the worker's wrapper sees: start_response, and whether it closes anyway."""

    def __init__(self, *, client_closes: bool = False) -> None:
        self.must_close = False
        self.req = SimpleNamespace(should_close=lambda: client_closes)
        self.started: list[str] = []

    def force_close(self) -> None:
        self.must_close = True

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        self.started.append(status)


def loaded_worker(counts: list[int]) -> Any:
    """A BalancedThreadWorker in slot 0 of a Spread holding `counts`, its app loaded as gunicorn loads it."""
    spread = Spread(len(counts))
    spread.counts[:] = counts
    worker: Any = object.__new__(BalancedThreadWorker)
    worker._leaving, worker._leaving_lock, worker._serving = 0, threading.Lock(), threading.local()
    worker.spread, worker.nr_conns = (spread, 0), counts[0]

    def flask_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"{}"]

    worker.app = SimpleNamespace(wsgi=lambda: flask_app)
    worker.load_wsgi()
    worker.flask_app = flask_app
    return worker


def test_whether_a_client_moves_is_decided_as_its_answer_starts_and_the_app_stays_reachable() -> None:
    worker = loaded_worker([16, 0])
    assert worker.wsgi.__wrapped__ is worker.flask_app  # gunicorn_conf.worker_exit closes the app's Triton clients
    conn, answer = SimpleNamespace(), Answer()
    worker._serving.conn = conn
    assert worker.wsgi({}, answer.start_response) == [b"{}"]
    assert answer.started == ["200 OK"] and answer.must_close and conn.shim_leaving
    assert worker._leaving == 1


def test_an_answer_that_closes_anyway_is_not_counted_as_a_client_moving() -> None:
    worker = loaded_worker([16, 0])
    conn, answer = SimpleNamespace(), Answer(client_closes=True)  # e.g. the client sent `Connection: close`
    worker._serving.conn = conn
    worker.wsgi({}, answer.start_response)
    assert worker._leaving == 0 and not hasattr(conn, "shim_leaving")
