"""Collect the concurrent requests of one worker into one batched backend call.

Each request thread submits one item and waits, until its deadline, for its own row or its own error. Sender
threads (one backend client each) never die: whatever a call raises, every request it took is answered. A sender
waits for more only while admitted requests are still preprocessing (Upstream), never past the delay: a lone
request goes at once, a burst as one batch. No sender takes more than its share of the worker's outstanding
requests (queued, on their way, in flight): a queue of 13 behind 2 senders goes as 7 and 6, not as 13 on one
backend instance while the other answers 1 at a time (bench/RESULTS.md, "Where the tail came from").
The sender also ranks the rows of its batch (scores, top k) at once: a request gets its answer ready to write.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from app import metrics
from app.backends.base import Backend, Rows, SendAgain
from app.errors import BackendError, BackendTimeout, BackendUnavailable, ShimError
from app.scores import Ranked, Ranking

log = logging.getLogger(__name__)


def triton_senders(instances: int, workers: int) -> int:
    """Triton requests in flight at once per worker: together the workers keep each model instance busy, and no
    more, since a request queued in Triton waits a whole batch behind another (it is never split). Two workers
    and two instances: one each; one worker: two (bench/RESULTS.md, "Connections spread over the workers")."""
    return max(1, -(-instances // max(1, workers)))


class Upstream:
    """How many requests of this worker are on their way to a batcher (decoding, preprocessing); shared by its
    batchers: a sender holds a batch open only while this is above zero."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0

    @contextlib.contextmanager
    def on_the_way(self) -> Iterator[Callable[[], None]]:
        """Count a request as on its way until it calls the yielded `arrived()` (or leaves, having failed)."""
        done = False

        def arrived() -> None:
            nonlocal done
            with self.cond:
                if not done:
                    done = True
                    self.count -= 1
                    if self.count == 0:  # a sender holding a batch open for it may go now; submit() wakes it too
                        self.cond.notify_all()

        with self.cond:
            self.count += 1
        try:
            yield arrived
        finally:
            arrived()


@dataclass
class _Pending:
    item: Any  # what the backend's prepare() made of the request's upload
    request_id: str
    future: Future[Ranked] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, backend: Backend, upstream: Upstream, *, ranking: Ranking, max_delay_s: float, senders: int,
                 turn: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.backend = backend
        self._ranking = ranking
        self._turn = turn  # the worker's decode bound, for what a SendAgain row needs done before it goes again
        self._upstream = upstream
        self._cond = upstream.cond  # one lock: a sender wakes for new requests and for upstream changes
        self._queue: collections.deque[_Pending] = collections.deque()
        self._collecting = threading.Lock()  # one sender builds a batch while the others send theirs
        self._max_delay_s = max_delay_s
        self._senders = senders
        self._in_flight = 0  # requests in the batches being sent now (under _cond)
        self._threads: list[threading.Thread] = []
        self._pid: int | None = None
        self._closed = False

    def submit(self, item: Any, request_id: str, *, timeout_s: float) -> Ranked:
        """The ranked row for this one item, within `timeout_s`; raises the request's own error. A row the
        backend asks for again (SendAgain) is prepared anew here, in the request's thread, and sent once more."""
        deadline = time.monotonic() + timeout_s
        try:
            return self._submit(item, request_id, timeout_s)
        except SendAgain as e:
            with self._turn():
                again = e.make()
            return self._submit(again, request_id, deadline - time.monotonic())

    def _submit(self, item: Any, request_id: str, timeout_s: float) -> Ranked:
        self._ensure_started()
        pending = _Pending(item, request_id)
        with self._cond:
            if self._closed:
                raise BackendUnavailable("the shim is shutting down", backend=self.backend.name)
            self._queue.append(pending)
            self._cond.notify_all()
        name = self.backend.name
        try:
            return pending.future.result(timeout=max(0.0, timeout_s))
        except FutureTimeout:
            # Still queued: no sender will take it (a timeout in the shim's own queue); already sent: its
            # answer is dropped when it comes. Each request is counted once, by what it was answered.
            queued = pending.future.cancel()
            metrics.BACKEND_ERRORS.labels(name, "queue_timeout" if queued else BackendTimeout.code).inc()
            where = "while queued in the shim" if queued else "(sent, still waiting for the answer)"
            raise BackendTimeout(f"no answer from {name} within {timeout_s:.3g} s {where}", backend=name) from None
        except BackendError as e:
            metrics.BACKEND_ERRORS.labels(name, e.code).inc()
            raise

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def _ensure_started(self) -> None:
        if self._pid == os.getpid():
            return
        with self._cond:
            if self._pid == os.getpid():
                return
            # Threads do not survive a fork: a batcher first used in a new process starts its own.
            self._threads = [threading.Thread(target=self._run, name=f"batcher-{self.backend.name}-{i}", daemon=True)
                             for i in range(self._senders)]
            for thread in self._threads:
                thread.start()
            self._pid = os.getpid()

    def _run(self) -> None:
        while True:
            batch: list[_Pending] = []
            try:
                with self._collecting:
                    taken = self._collect()
                if taken is None:
                    return
                batch = taken
                self._send(batch)
            except Exception as e:  # the sender's outermost frame: a bug must neither kill it nor strand requests
                log.exception("the %s batch sender failed unexpectedly; it goes on", self.backend.name)
                self._fail(batch, BackendError(f"{self.backend.name} failed: {type(e).__name__}: {e}"))

    def _collect(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            limit = max(1, self.backend.max_batch_size)
            deadline = time.monotonic() + self._max_delay_s
            while len(batch) < min(limit, self._share(len(batch))):
                if self._queue:
                    batch.append(self._queue.popleft())
                    continue
                remaining = deadline - time.monotonic()
                if self._upstream.count == 0 or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            taken = [p for p in batch if p.future.set_running_or_notify_cancel()]  # drop requests that gave up
            self._in_flight += len(taken)
        return taken

    def _share(self, collected: int) -> int:
        """The most one batch may take now: the worker's outstanding requests over its senders, rounded up."""
        outstanding = collected + len(self._queue) + self._upstream.count + self._in_flight
        return -(-outstanding // self._senders)

    def _send(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        name = self.backend.name
        started, cpu = time.perf_counter(), time.thread_time()
        for pending in batch:
            metrics.STAGE_SECONDS.labels("queue", name).observe(started - pending.enqueued)
        metrics.BATCH_SIZE.labels(name).observe(len(batch))
        rows: Rows | None = None
        try:
            rows = self._infer(batch)
        except (BackendUnavailable, BackendTimeout) as e:
            self._fail(batch, e)  # the backend is down for everyone: retrying one by one only adds load
        except BackendError as e:
            if len(batch) == 1:
                self._fail(batch, e)
            else:  # one bad request must not fail the others: each one alone gets its own answer or error
                log.warning("%s failed a batch of %d (%s); retrying each request alone", name, len(batch), e)
                for pending in batch:
                    self._send_alone(pending)
        finally:
            with self._cond:
                self._in_flight -= len(batch)
            metrics.STAGE_SECONDS.labels("infer", name).observe(time.perf_counter() - started)
            metrics.CPU_SECONDS.labels("send", name).inc(time.thread_time() - cpu)
        if rows is not None:
            self._answer(batch, rows)

    def _infer(self, batch: list[_Pending]) -> Rows:
        logits = self.backend.infer([p.item for p in batch], [p.request_id for p in batch])
        if len(logits) != len(batch):
            raise BackendError(f"{self.backend.name} returned {len(logits)} answers for {len(batch)} requests")
        return logits

    def _answer(self, batch: list[_Pending], rows: Rows) -> None:
        """Each request its ranked row, or its own error (its upload): the good rows ranked together."""
        started, cpu = time.perf_counter(), time.thread_time()
        pairs = list(zip(batch, rows, strict=True))
        good = [(pending, row) for pending, row in pairs if not isinstance(row, ShimError)]
        ranked = self._ranking.rank([row for _, row in good])
        wall = time.perf_counter() - started
        metrics.CPU_SECONDS.labels("postprocess", self.backend.name).inc(time.thread_time() - cpu)
        waited = metrics.STAGE_SECONDS.labels("postprocess", self.backend.name)
        for (pending, _), answer in zip(good, ranked, strict=True):
            waited.observe(wall)  # each request of the batch waited for it
            pending.future.set_result(answer)
        for pending, row in pairs:
            if isinstance(row, ShimError):  # this request's own error (its upload), not the batch's
                pending.future.set_exception(row)

    def _send_alone(self, pending: _Pending) -> None:
        try:
            self._answer([pending], self._infer([pending]))
        except BackendError as e:
            self._fail([pending], e)

    def _fail(self, batch: list[_Pending], error: BackendError) -> None:
        """Every request of `batch` not answered yet raises its own copy of `error`."""
        error.backend = self.backend.name
        for pending in [p for p in batch if not p.future.done()]:  # counted by submit(), the request's own
            pending.future.set_exception(error.copy())
