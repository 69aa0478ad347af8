"""The batcher at the Backend seam, with a fake backend (tests/integration has it against the real Triton)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from app.batching import Batcher, Upstream
from app.errors import BackendError, BackendTimeout, BackendUnavailable
from app.scores import SCORE_FUNCTIONS, Ranking
from tests.fakes import POISON, EchoBackend, item

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

TIMEOUT_S = 30.0


def make_batcher(backend: EchoBackend, delay_s: float = 0.05, senders: int = 1) -> tuple[Batcher, Upstream]:
    upstream = Upstream()
    return Batcher(backend, upstream, ranking=Ranking(5), max_delay_s=delay_s, senders=senders), upstream


def submit_together(batcher: Batcher, upstream: Upstream, values: list[float]) -> list[object]:
    """Like concurrent requests: each is admitted (decoding...) before any of them is submitted."""
    barrier = threading.Barrier(len(values))

    def one(value: float) -> object:
        with upstream.on_the_way() as arrived:
            barrier.wait()
            arrived()
            try:
                return batcher.submit(item(value), f"req-{value}", timeout_s=TIMEOUT_S)
            except Exception as e:
                return e

    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(one, values))


def test_concurrent_requests_share_one_call_and_each_gets_its_own_row() -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend)
    values = [float(v) for v in range(1, 17)]
    answers = submit_together(batcher, upstream, values)
    assert [a.outputs[0] for a in answers] == values  # type: ignore[index]
    assert sum(backend.batches) == 16 and len(backend.batches) < 16, backend.batches
    assert sorted(i for ids in backend.request_ids for i in ids) == sorted(f"req-{v}" for v in values)
    batcher.close()


def test_batches_never_exceed_the_backends_max_batch_size() -> None:
    backend = EchoBackend(max_batch_size=4)
    batcher, upstream = make_batcher(backend)
    answers = submit_together(batcher, upstream, [float(v) for v in range(1, 11)])
    assert len(answers) == 10 and max(backend.batches) <= 4
    batcher.close()


def test_a_lone_request_does_not_wait_for_the_delay() -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend, delay_s=3600.0)  # waiting for it would time the request out
    with upstream.on_the_way() as arrived:
        arrived()
    row = batcher.submit(item(3.0), "lone", timeout_s=TIMEOUT_S)
    assert row.outputs[0] == 3.0, "nothing else was on its way: the batch should leave at once"
    batcher.close()


def test_a_bad_request_fails_alone_and_its_batch_mates_get_their_answers() -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend)
    answers = submit_together(batcher, upstream, [1.0, 2.0, POISON, 4.0])
    assert isinstance(answers[2], BackendError)
    assert [a.outputs[0] for i, a in enumerate(answers) if i != 2] == [1.0, 2.0, 4.0]  # type: ignore[index]
    batcher.close()


def test_an_unavailable_backend_fails_each_request_with_its_own_error() -> None:
    backend = EchoBackend()
    backend.down = True
    batcher, upstream = make_batcher(backend)
    answers = submit_together(batcher, upstream, [1.0, 2.0, 3.0])
    assert all(isinstance(a, BackendUnavailable) for a in answers)
    assert len({id(a) for a in answers}) == 3, "threads must not share (and re-raise) one exception object"
    assert sum(backend.batches) == 3, "an outage is not retried request by request"
    batcher.close()


def test_a_sender_survives_a_bug_in_the_backend_and_answers_every_request() -> None:
    """A backend raising something that is not a BackendError, in a batch and then alone, must not kill the
    sender thread: every request gets an error, and later requests get answers from the same sender."""
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend, senders=1)
    backend.broken = True
    failed = submit_together(batcher, upstream, [1.0, 2.0, 3.0])
    assert all(isinstance(a, BackendError) and "ZeroDivisionError" in str(a) for a in failed), failed
    backend.broken = False
    answers = submit_together(batcher, upstream, [4.0, 5.0])
    assert [a.outputs[0] for a in answers] == [4.0, 5.0], answers  # type: ignore[index]
    batcher.close()


def test_each_request_gets_its_own_row_ranked_by_the_batchers_ranking() -> None:
    backend = EchoBackend()
    upstream = Upstream()
    batcher = Batcher(backend, upstream, ranking=Ranking(3, SCORE_FUNCTIONS["probabilities"]), max_delay_s=0.05,
                      senders=1)
    answers = submit_together(batcher, upstream, [0.5, -1.0, 2.0])
    # EchoBackend's row: the value in class 0, zeros elsewhere; probabilities as they come, ties in class order.
    assert [(a.classes, a.scores) for a in answers] == [  # type: ignore[attr-defined]
        ([0, 1, 2], [0.5, 0.0, 0.0]), ([1, 2, 3], [0.0, 0.0, 0.0]), ([0, 1, 2], [2.0, 0.0, 0.0])]
    batcher.close()


def test_a_bug_in_the_ranking_fails_its_batch_with_an_error_and_the_sender_goes_on() -> None:
    calls = []

    def scores_failing_once(rows: np.ndarray) -> np.ndarray:
        calls.append(len(rows))
        if len(calls) == 1:
            raise FloatingPointError("a bug in the scores")
        return SCORE_FUNCTIONS["softmax"](rows)

    backend, upstream = EchoBackend(), Upstream()
    batcher = Batcher(backend, upstream, ranking=Ranking(5, scores_failing_once), max_delay_s=0.05, senders=1)
    failed = submit_together(batcher, upstream, [1.0])
    assert isinstance(failed[0], BackendError) and "FloatingPointError" in str(failed[0]), failed
    assert [a.outputs[0] for a in submit_together(batcher, upstream, [2.0, 3.0])] == [2.0, 3.0]  # type: ignore[attr-defined]
    batcher.close()


def test_a_bug_during_the_one_by_one_retry_does_not_kill_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend, senders=1)
    original = backend.infer

    def bad_batch_then_bug(batch: object, request_ids: list[str]) -> object:
        if len(request_ids) > 1:
            raise BackendError("one request of this batch is bad", backend="fake")  # -> retry one by one
        raise KeyError("a bug while retrying alone")

    monkeypatch.setattr(backend, "infer", bad_batch_then_bug)
    failed = submit_together(batcher, upstream, [1.0, 2.0, 3.0])
    assert all(isinstance(a, BackendError) for a in failed), failed
    monkeypatch.setattr(backend, "infer", original)
    assert submit_together(batcher, upstream, [6.0])[0].outputs[0] == 6.0  # type: ignore[index]
    batcher.close()


def test_a_request_waits_no_longer_than_its_timeout() -> None:
    backend = EchoBackend()
    batcher, _ = make_batcher(backend)
    backend.hang.set()
    try:
        with pytest.raises(BackendTimeout, match=r"within 0\.2 s") as raised:
            batcher.submit(item(1.0), "slow", timeout_s=0.2)
        assert raised.value.backend == "fake"
    finally:
        backend.hang.clear()
    assert batcher.submit(item(2.0), "next", timeout_s=TIMEOUT_S).outputs[0] == 2.0
    batcher.close()


def test_a_queue_behind_busy_senders_is_shared_between_them() -> None:
    """13 requests queued while both senders wait on the backend: the first sender back must not take them all
    (one backend instance computing 13 while the other answers 1 at a time made the CPU run's tail)."""
    backend = EchoBackend()
    batcher, _ = make_batcher(backend, senders=2)
    backend.hang.set()
    with ThreadPoolExecutor(15) as pool:
        first = [pool.submit(batcher.submit, item(float(v)), f"busy-{v}", timeout_s=TIMEOUT_S) for v in (1, 2)]
        wait_for(lambda: len(backend.batches) == 2, "both senders to be busy")
        queued = [pool.submit(batcher.submit, item(float(v)), f"queued-{v}", timeout_s=TIMEOUT_S)
                  for v in range(3, 16)]
        wait_for(lambda: len(batcher._queue) == 13, "13 requests to be queued")
        backend.hang.clear()
        answers = [f.result(timeout=TIMEOUT_S).outputs[0] for f in first + queued]
    assert answers == [float(v) for v in range(1, 16)]
    assert backend.batches[:2] == [1, 1] and sum(backend.batches) == 15
    assert max(backend.batches[2:]) <= 7, f"one sender took more than its share: {backend.batches}"
    batcher.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
