"""Collect the concurrent requests of one worker into one batched backend call.

Each request thread submits one preprocessed image and waits for its own row of logits. Sender threads
(each with its own backend client) take what is queued, stack it into [N, 3, H, W] up to the backend's
max batch size, make one call, and hand every request exactly its own answer, or its own error.

A sender waits for more requests only while others are on their way (admitted into the worker but
still decoding or preprocessing) and never longer than the delay: a lone request goes out at once, a
burst leaves as one batch. Triton's dynamic batcher then merges the batches of several workers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from app import metrics
from app.backends.base import Backend
from app.errors import BackendError, BackendTimeout, BackendUnavailable, ShimError

log = logging.getLogger(__name__)


class Upstream:
    """Requests admitted into this worker that have not reached a batcher yet; shared by all batchers."""

    def __init__(self) -> None:
        self.cond = threading.Condition()  # reentrant: Admission.leave() may run with it held
        self.count = 0

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Admission]:
        """Count a request as on its way until it is submitted to a batcher, or fails before that."""
        admission = Admission(self)
        with self.cond:
            self.count += 1
        try:
            yield admission
        finally:
            admission.leave()


class Admission:
    def __init__(self, upstream: Upstream) -> None:
        self._upstream, self._left = upstream, False

    def leave(self) -> None:
        with self._upstream.cond:
            if not self._left:
                self._left = True
                self._upstream.count -= 1
                self._upstream.cond.notify_all()


@dataclass
class _Pending:
    tensor: npt.NDArray[np.float32]
    request_id: str
    future: Future[npt.NDArray[np.float32]] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, backend: Backend, upstream: Upstream, *, max_delay_s: float, senders: int,
                 result_timeout_s: float) -> None:
        self.backend = backend
        self._upstream = upstream
        self._cond = upstream.cond  # one lock: a sender wakes for new requests and for upstream changes
        self._queue: collections.deque[_Pending] = collections.deque()
        self._collecting = threading.Lock()  # one sender builds a batch while the others send theirs
        self._max_delay_s = max_delay_s
        self._senders = senders
        self._result_timeout_s = result_timeout_s
        self._threads: list[threading.Thread] = []
        self._pid: int | None = None
        self._closed = False

    def submit(self, tensor: npt.NDArray[np.float32], request_id: str, admission: Admission | None = None,
               timeout_s: float | None = None) -> npt.NDArray[np.float32]:
        """The logits row for this one image; raises the request's own ShimError."""
        timeout_s = self._result_timeout_s if timeout_s is None else timeout_s
        self._ensure_started()
        pending = _Pending(tensor, request_id)
        with self._cond:
            if self._closed:
                raise BackendUnavailable("the shim is shutting down")
            self._queue.append(pending)
            if admission is not None:
                admission.leave()  # no longer on its way: it is here
            self._cond.notify_all()
        try:
            return pending.future.result(timeout=timeout_s)
        except FutureTimeout:
            pending.future.cancel()
            raise BackendTimeout(f"no answer from {self.backend.name} within {timeout_s:g} s") from None

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
            with self._collecting:
                batch = self._collect()
            if batch is None:
                return
            self._send(batch)

    def _collect(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            limit = max(1, self.backend.max_batch_size)
            deadline = time.monotonic() + self._max_delay_s
            while len(batch) < limit:
                if self._queue:
                    batch.append(self._queue.popleft())
                    continue
                remaining = deadline - time.monotonic()
                if self._upstream.count == 0 or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
        return [p for p in batch if p.future.set_running_or_notify_cancel()]  # drop requests that gave up

    def _send(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        name = self.backend.name
        started = time.perf_counter()
        for pending in batch:
            metrics.STAGE_SECONDS.labels("queue", name).observe(started - pending.enqueued)
        metrics.BATCH_SIZE.labels(name).observe(len(batch))
        try:
            logits = self.backend.infer(np.stack([p.tensor for p in batch]), [p.request_id for p in batch])
            if len(logits) != len(batch):
                raise BackendError(f"{name} returned {len(logits)} answers for {len(batch)} requests")
        except (BackendUnavailable, BackendTimeout) as e:
            self._fail(batch, e)  # the backend is down for everyone: retrying one by one only adds load
        except ShimError as e:
            if len(batch) == 1:
                self._fail(batch, e)
            else:  # one bad request must not fail the others: each one alone gets its own answer or error
                log.warning("%s failed a batch of %d (%s); retrying each request alone", name, len(batch), e)
                for pending in batch:
                    self._send_alone(pending)
        except Exception as e:  # the sender thread's outermost frame: a bug must not strand the requests
            log.exception("%s raised an unexpected error for a batch of %d", name, len(batch))
            self._fail(batch, BackendError(f"{name} failed: {type(e).__name__}: {e}"))
        else:
            for pending, row in zip(batch, logits, strict=True):
                pending.future.set_result(row)
        finally:
            metrics.STAGE_SECONDS.labels("infer", name).observe(time.perf_counter() - started)

    def _send_alone(self, pending: _Pending) -> None:
        try:
            pending.future.set_result(self.backend.infer(pending.tensor[None], [pending.request_id])[0])
        except ShimError as e:
            self._fail([pending], e)

    def _fail(self, batch: list[_Pending], error: ShimError) -> None:
        metrics.BACKEND_ERRORS.labels(self.backend.name, error.code).inc()
        for pending in batch:
            own = type(error)(error.message)  # each request raises its own exception object
            own.__cause__ = error.__cause__ or error
            pending.future.set_exception(own)
