"""app/backends/triton against the real server: metadata checks and error translation."""

from __future__ import annotations

import logging
import re
import socket
import threading

import numpy as np
import pytest

from app.backends.triton import TritonBackend
from app.backends.triton.checks import check_model
from app.errors import BackendTimeout, BackendUnavailable, ModelMismatch
from devstack import EmbeddedTriton
from tests.fakes import item
from tests.support import triton_backend

pytestmark = pytest.mark.triton
IMAGE = (3, 224, 224)


def backend(url: str, model: str = "resnet50", classes: int = 1000, timeout_s: float = 10) -> TritonBackend:
    backend: TritonBackend = triton_backend(url, model=model, classes=classes, network_timeout_s=timeout_s,
                                            readiness_timeout_s=1, max_batch_size=64)
    return backend


def test_ready_model_with_matching_metadata(triton: EmbeddedTriton) -> None:
    b = backend(triton.http_url)
    state = b.ready()
    assert state.ready, state.detail
    assert b.max_batch_size == 32, "capped by the model's own max_batch_size"
    logits = np.stack(b.infer([item(0.0), item(1.0)], ["a", "b"]))
    assert logits.shape == (2, 1000)
    b.close()


@pytest.mark.parametrize(("model", "classes", "message"), [
    ("resnet50_uint8", 1000, r"input 'input__0' is UINT8 \[-1, 224, 224, 3\]; the shim sends FP32 \[-1, 3, 224, 224\]"),
    ("resnet50", 10, r"output 'output__0' is FP32 \[-1, 1000\]; the shim expects FP32 \[-1, 10\]"),
    ("no_such_model", 1000, r"Triton model 'no_such_model' at .* is (unavailable|not ready)"),
])
def test_a_mismatch_or_missing_model_keeps_readiness_off_with_one_clear_message(
        triton: EmbeddedTriton, model: str, classes: int, message: str) -> None:
    b = backend(triton.http_url, model=model, classes=classes)
    state = b.ready()
    assert not state.ready
    assert re.search(message, state.detail), state.detail
    with pytest.raises(BackendUnavailable, match=message):
        b.infer([item(0.0)], ["x"])
    b.close()


def test_every_request_id_of_a_full_batch_reaches_triton(triton: EmbeddedTriton,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Triton echoes the ID it received in its answer: all 32 of a full batch must be there, not a cut."""
    ids = [f"{i:02d}-" + "abcdef0123456789" * 2 for i in range(32)]  # 35 characters each, as uuid4().hex + more
    b = backend(triton.http_url)
    with caplog.at_level(logging.DEBUG, logger="app.backends.triton"):
        b.infer([item(float(i)) for i in range(32)], ids)
    b.close()
    (echoed,) = [r.triton_request_id for r in caplog.records if hasattr(r, "triton_request_id")]
    assert echoed.split(",") == ids


def test_readiness_of_a_silent_server_answers_within_its_own_deadline() -> None:
    with socket.socket() as silent:  # accepts connections, never answers (as a SIGSTOPped Triton)
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        b = backend(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=30)
        state = b.ready()
        assert not state.ready and "did not answer within 1 s" in state.detail, state.detail
        b.close()


def test_unreachable_is_503_and_silent_server_is_504() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(BackendUnavailable, match="unreachable"):
        backend(f"127.0.0.1:{port}").infer([item(0.0)], ["x"])

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        b = backend(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1)
        with pytest.raises(BackendTimeout, match="did not answer within 1"):
            b.infer([item(0.0)], ["x"])
        b.close()


def test_a_connection_closed_before_the_answer_is_503_not_a_bug() -> None:
    """What Triton does to open keep-alive connections when it shuts down."""
    with socket.socket() as rude:
        rude.bind(("127.0.0.1", 0))
        rude.listen()
        port = rude.getsockname()[1]

        def hang_up() -> None:
            for _ in range(4):  # tritonclient may try again on a fresh connection
                try:
                    conn, _ = rude.accept()
                except OSError:  # the test closed the listener: no more tries came
                    return
                conn.recv(65536)
                conn.close()

        rudeness = threading.Thread(target=hang_up, daemon=True)
        rudeness.start()
        with pytest.raises(BackendUnavailable, match="unreachable"):
            backend(f"127.0.0.1:{port}").infer([item(0.0)], ["x"])
        rude.shutdown(socket.SHUT_RDWR)  # wakes an accept() still waiting, here and not in a later test
    rudeness.join(timeout=10)
    assert not rudeness.is_alive()


def test_a_connect_that_times_out_is_503_not_504() -> None:
    """A stopped container's address: nothing accepts the connection (a full backlog drops the SYN)."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = full.getsockname()
        queued: list[socket.socket] = []
        try:
            while len(queued) < 8:  # fill the accept queue until a connect times out
                probe = socket.socket()
                probe.settimeout(0.5)
                try:
                    probe.connect(address)
                except TimeoutError:
                    probe.close()
                    break
                queued.append(probe)
            b = backend(f"127.0.0.1:{address[1]}", timeout_s=30)
            with pytest.raises(BackendUnavailable, match="accepts no connection"):
                b.infer([item(0.0)], ["x"])
            b.close()
        finally:
            for conn in queued:
                conn.close()


def test_check_model_accepts_the_articles_model() -> None:
    meta = {"inputs": [{"name": "input__0", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
            "outputs": [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1000]}], "versions": ["1"]}
    spec = check_model(meta, {"max_batch_size": 32}, image_shape=IMAGE, classes=1000, where="m")
    assert (spec.input_name, spec.output_name, spec.max_batch_size) == ("input__0", "output__0", 32)
    two_outputs = {**meta, "outputs": meta["outputs"] * 2}
    with pytest.raises(ModelMismatch, match="1 inputs and 2 outputs"):
        check_model(two_outputs, {}, image_shape=IMAGE, classes=1000, where="m")
