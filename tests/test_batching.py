"""The batcher at the Backend seam (a fake backend), then the real shim against the real Triton."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from app.batching import Batcher, Upstream
from app.errors import BackendError, BackendUnavailable
from tests.conftest import ServedApp
from tests.fakes import POISON, EchoBackend, image
from tests.support import encode, photo


def make_batcher(backend: EchoBackend, delay_s: float = 0.05, senders: int = 1) -> tuple[Batcher, Upstream]:
    upstream = Upstream()
    return Batcher(backend, upstream, max_delay_s=delay_s, senders=senders, result_timeout_s=30), upstream


def submit_together(batcher: Batcher, upstream: Upstream, values: list[float]) -> list[object]:
    """Like concurrent requests: each is admitted (decoding...) before any of them is submitted."""
    barrier = threading.Barrier(len(values))

    def one(value: float) -> object:
        with upstream.admitted() as admission:
            barrier.wait()
            try:
                return batcher.submit(image(value), f"req-{value}", admission)
            except Exception as e:
                return e

    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(one, values))


def test_concurrent_requests_share_one_call_and_each_gets_its_own_row() -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend)
    values = [float(v) for v in range(1, 17)]
    answers = submit_together(batcher, upstream, values)
    assert [a[0] for a in answers] == values  # type: ignore[index]
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
    batcher, upstream = make_batcher(backend, delay_s=10.0)
    started = time.monotonic()
    with upstream.admitted() as admission:
        row = batcher.submit(image(3.0), "lone", admission)
    assert row[0] == 3.0
    assert time.monotonic() - started < 5.0, "nothing else was on its way: the batch should leave at once"
    batcher.close()


def test_a_bad_request_fails_alone_and_its_batch_mates_get_their_answers() -> None:
    backend = EchoBackend()
    batcher, upstream = make_batcher(backend)
    answers = submit_together(batcher, upstream, [1.0, 2.0, POISON, 4.0])
    assert isinstance(answers[2], BackendError)
    assert [a[0] for i, a in enumerate(answers) if i != 2] == [1.0, 2.0, 4.0]  # type: ignore[index]
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


@pytest.mark.triton
def test_shim_sends_fewer_triton_requests_than_it_receives_and_answers_each_correctly(
        shim_triton: ServedApp, triton_client: object) -> None:
    images = [encode(photo(640, 480, seed=100 + i), "JPEG") for i in range(16)]

    def predict(data: bytes) -> dict:
        answer = requests.post(shim_triton.url + "/predict", files={"image": data}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    alone = [predict(data) for data in images]  # one at a time: batches of one

    def triton_requests() -> int:
        stats = triton_client.get_inference_statistics("resnet50")  # type: ignore[attr-defined]
        return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])

    before = triton_requests()
    rounds = 4
    with ThreadPoolExecutor(16) as pool:
        together = [list(pool.map(predict, images)) for _ in range(rounds)]
    sent = triton_requests() - before
    assert sent < 16 * rounds, f"{sent} Triton requests for {16 * rounds} client requests: the shim did not batch"
    for answers in together:
        for single, batched in zip(alone, answers, strict=True):
            assert [p["label"] for p in batched["predictions"]] == [p["label"] for p in single["predictions"]]
            np.testing.assert_allclose([p["score"] for p in batched["predictions"]],
                                       [p["score"] for p in single["predictions"]], rtol=0, atol=1e-5)
