"""Every transport to the real Triton gives today's logits; the encoded one sends the uploads of a batch as one
Triton request, and a corrupt upload among them fails only itself."""

from __future__ import annotations

import numpy as np
import pytest

from app.backends.base import SendAgain
from app.errors import InvalidImage
from app.images import Upload
from app.preprocess import ImageSpec
from devstack import EmbeddedTriton
from tests.support import encode, photo, scrape, triton_backend

SPEC = ImageSpec()
JPEGS = [encode(photo(640, 480, seed=40 + i), "JPEG") for i in range(5)]


def send(transport: str, url: str, uploads: list[bytes]) -> list[object]:
    backend = triton_backend(url, transport)
    try:
        state = backend.ready()
        assert state.ready, state.detail
        assert f"transport {transport}" in state.detail, state.detail
        return list(backend.infer([backend.prepare(Upload(data, SPEC)) for data in uploads],
                                  [f"r{i}" for i in range(len(uploads))]))
    finally:
        backend.close()


@pytest.fixture(scope="module")
def today(triton: EmbeddedTriton) -> np.ndarray:
    """What the shim sent before transports existed: FP32 tensors in the HTTP body."""
    return np.stack(send("fp32", triton.http_url, JPEGS))  # type: ignore[arg-type]


def test_uint8_gives_todays_logits(triton: EmbeddedTriton, today: np.ndarray) -> None:
    logits = np.stack(send("uint8", triton.http_url, JPEGS))  # type: ignore[arg-type]
    alone = np.stack(send("uint8", triton.http_url, JPEGS[:1]))  # type: ignore[arg-type]
    assert np.abs(logits - today).max() <= 1e-5, np.abs(logits - today).max()
    assert np.abs(alone - today[:1]).max() <= 1e-5


def triton_counts(triton: EmbeddedTriton, model: str) -> tuple[float, float]:
    """(requests, images) Triton counted for `model`."""
    samples = scrape(triton.metrics_url)
    return tuple(sum(s.value for s in samples if s.matches(name, {"model": model}))  # type: ignore[return-value]
                 for name in ("nv_inference_request_success", "nv_inference_count"))


def test_encoded_sends_a_batch_as_one_request_and_a_corrupt_upload_fails_alone(
        triton: EmbeddedTriton, today: np.ndarray) -> None:
    at = JPEGS[1].find(b"\xff\xc4")  # a bogus Huffman table: the header and EOI are fine, only the decoder can tell
    truncated = JPEGS[1][:at + 4] + b"\x00" + b"\xff" * 16 + JPEGS[1][at + 21:]
    requests_before, images_before = triton_counts(triton, "resnet50_encoded")
    rows = send("encoded", triton.http_url, [JPEGS[0], truncated, *JPEGS[2:]])
    requests_after, images_after = triton_counts(triton, "resnet50_encoded")
    assert (requests_after - requests_before, images_after - images_before) == (1, 5), "one request of five uploads"
    assert isinstance(rows[1], SendAgain), rows[1]  # back to its request's thread, which decodes it there
    with pytest.raises(InvalidImage) as refused:  # by the legacy rules, which cannot read it either
        rows[1].make()
    assert refused.value.status == 400
    good = np.stack([rows[0], *rows[2:]])  # type: ignore[list-item]
    want = today[[0, 2, 3, 4]]
    assert good.shape == (4, 1000)
    assert np.abs(good - want).max() < 0.05 * np.abs(want).max(), np.abs(good - want).max()
