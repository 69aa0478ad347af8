"""gunicorn's gthread worker, except that a worker holding more connections than another lets that one take
a new connection first, and closes a kept-alive one (announced: `Connection: close`) while it holds two more.

Why: every gthread worker polls the one listening socket and the first awake takes what arrives. Sixteen
keep-alive clients landed 16 / 0, 9 / 7 and 12 / 4 on two workers (bench/RESULTS.md, "Connections spread over
the workers"): one worker's GIL doing all the work, or two batchers with equal shares of Triton serving unequal
numbers of clients, so that one group of clients waited 1.5-3x as long as the other.

Connections that came before a worker was up (a restart, the first worker ready while the second boots) move too:
their clients reconnect after an answer that says so, never in the middle of a request. Whether a client moves is
decided as its answer starts, so a request sent before the other worker was up moves with its own answer, not with
the next one a cycle later (3.8 s batches on a CPU). The clients told to go count as gone from here and arrived
there until their connection closes, so that the threads answering one batch at once move what evens the counts,
not every client they answered (bench/RESULTS.md has both).

A thread that has answered a kept-alive client waits up to LINGER_S for that client's next request and serves it
too, while every connection of the worker can have a thread of its own: under load the next request comes
within a millisecond or two, and going back through gthread's poller, its thread pool and its main thread cost
four context switches and about 5 % of the shim's CPU per image (bench/RESULTS.md, "A kept-alive client stays
with its thread"). An idle client goes back to the poller as in plain gthread.

The counts are one shared int per worker (`Spread`, made by the master before it forks and handed to each
worker in `pre_fork`). A worker waits for another at most DEFER_S per connection: a hung or busy worker delays
a new connection by that much, never refuses it.
"""

from __future__ import annotations

import select
import threading
import time
from multiprocessing.sharedctypes import RawArray
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

DEFER_S = 0.005  # the longest a new connection waits for a less loaded worker (a busy one wakes within a GIL switch)
LINGER_S = 0.05  # how long a thread waits for the next request of the client it answered (then: the poller)
NOT_ACCEPTING = -1  # a free slot, or a worker not taking connections (stopping, or at worker_connections)


class Spread:
    """The open connections of each worker, in memory the master's forks share: one slot per worker."""

    def __init__(self, slots: int) -> None:
        self.counts = RawArray("i", [NOT_ACCEPTING] * slots)
        self._used: set[int] = set()  # the master's own record of the slots its workers hold

    def assign(self, worker: Any) -> None:
        """In the master, before the fork: the lowest free slot. It counts once the worker's loop runs."""
        slot = next((i for i in range(len(self.counts)) if i not in self._used), None)
        if slot is None:  # more workers at once than slots (a reload's overlap): this one simply goes unbalanced
            return
        self._used.add(slot)
        self.counts[slot] = NOT_ACCEPTING
        worker.spread = (self, slot)

    def release(self, worker: Any) -> None:
        """In the master, when a worker has exited: its slot is free and counts for nobody."""
        spread = getattr(worker, "spread", None)
        if spread is not None:
            self.counts[spread[1]] = NOT_ACCEPTING
            self._used.discard(spread[1])

    def fewest_elsewhere(self, slot: int) -> int | None:
        """The fewest connections another accepting worker holds; None when no other worker accepts."""
        others = [c for i, c in enumerate(self.counts) if i != slot and c != NOT_ACCEPTING]
        return min(others) if others else None


def should_move(mine: int, fewest_elsewhere: int | None, leaving: int = 0) -> bool:
    """Close this connection after its answer: another worker holds at least two fewer (one less would only swap),
    counting the `leaving` clients already told to go as gone from here and arrived there."""
    return fewest_elsewhere is not None and mine - leaving > fewest_elsewhere + leaving + 1


def next_request_within(conn: Any, timeout_s: float) -> bool:
    """The client's next request has begun to arrive (read ahead already, or the socket readable) within timeout_s."""
    if conn.parser.unreader.buf.getbuffer().nbytes:
        return True
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def should_wait(mine: int, fewest_elsewhere: int | None, waited_s: float) -> bool:
    """Leave a new connection to another worker: it holds fewer, and this one has not waited DEFER_S for it."""
    return fewest_elsewhere is not None and mine > fewest_elsewhere and waited_s < DEFER_S


class BalancedThreadWorker(ThreadWorker):  # type: ignore[misc]
    """gthread; `accept` steps aside while another worker holds fewer connections (for DEFER_S at most), and a
    thread serves its client's next request when it comes within linger_s."""

    spread: tuple[Spread, int] | None = None
    linger_s = LINGER_S
    _waiting_since: float | None = None
    _offered = False  # the listener was readable in this round of events

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Clients told to reconnect whose connection is not closed yet: threads answering at once see each
        # other's decisions, so a 9 / 7 moves one client, not all that were answered together (then 6 / 10).
        self._leaving = 0
        self._leaving_lock = threading.Lock()
        self._serving = threading.local()  # .conn: the connection this thread answers

    def _publish(self) -> None:
        if self.spread is not None:
            spread, slot = self.spread
            spread.counts[slot] = self.nr_conns if self.alive and self._accepting else NOT_ACCEPTING

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        self._publish()
        self._offered = False
        super().wait_for_and_dispatch_events(timeout)
        if not self._offered:  # nothing waited to be accepted: the next connection starts its own wait
            self._waiting_since = None
        self._publish()

    def handle(self, conn: Any) -> Any:
        """gthread's, then the same client's next requests in this thread while they come within linger_s and the
        worker holds no more connections than threads (so that a lingering thread keeps nobody waiting)."""
        keepalive = super().handle(conn)
        while (keepalive is True and self.alive and self.nr_conns <= self.cfg.threads
               and next_request_within(conn, self.linger_s)):
            keepalive = super().handle(conn)
        return keepalive

    def load_wsgi(self) -> None:
        """The app, wrapped so that whether this client moves is decided as its answer starts (see handle_request)."""
        super().load_wsgi()
        app: Any = self.wsgi  # type: ignore[has-type]  # set by gunicorn, untyped

        def deciding_at_the_answer(environ: dict[str, Any], start_response: Any) -> Any:
            def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                self._decide_move(start_response.__self__)  # gunicorn's Response, whose headers are not sent yet
                return start_response(status, headers, exc_info)
            return app(environ, start)

        deciding_at_the_answer.__wrapped__ = app  # type: ignore[attr-defined]  # gunicorn_conf's worker_exit
        self.wsgi = deciding_at_the_answer

    def handle_request(self, req: Any, conn: Any) -> Any:
        # Decided when the answer starts, not when the request does: a request begun before another worker was
        # up (3.8 s batches on a CPU) would otherwise move its client only after the next one, a cycle later.
        self._serving.conn = conn
        return super().handle_request(req, conn)

    def _decide_move(self, resp: Any) -> None:
        if self.spread is None or resp.must_close or resp.req.should_close():  # closing anyway (stopping, HTTP/1.0)
            return
        spread, slot = self.spread
        with self._leaving_lock:
            if should_move(self.nr_conns, spread.fewest_elsewhere(slot), self._leaving):
                self._leaving += 1
                self._serving.conn.shim_leaving = True
                resp.force_close()  # gunicorn answers `Connection: close` and closes after the answer

    def finish_request(self, conn: Any, fs: Any) -> None:
        super().finish_request(conn, fs)  # on the main thread: a closed connection has left nr_conns here
        if getattr(conn, "shim_leaving", False):
            conn.shim_leaving = False
            with self._leaving_lock:
                self._leaving -= 1

    def accept(self, listener: Any) -> None:
        self._offered = True
        if self.spread is not None:
            spread, slot = self.spread
            now = time.monotonic()
            if self._waiting_since is None:
                self._waiting_since = now
            if should_wait(self.nr_conns, spread.fewest_elsewhere(slot), now - self._waiting_since):
                time.sleep(0.0005)  # the listener stays readable: yield, rather than spin, while the other takes it
                return
        self._waiting_since = None
        super().accept(listener)
        self._publish()
