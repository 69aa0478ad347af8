"""The encoded transport against the real Triton: resnet50_decode's tensor against the legacy one, uploads
as they came through the shim under gunicorn, a corrupt one among good ones, shadow mode comparing it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from PIL import Image

from app.backends.base import SendAgain
from app.backends.triton import TritonBackend
from app.errors import InvalidImage
from app.images import Upload
from app.preprocess import ImageSpec, decode, to_tensor
from app.sniff import cpu_reason
from devstack import EmbeddedTriton
from devstack.launch import ServedApp
from tests.conftest import shim_traffic, start_shim, stop_soon
from tests.support import encode, photo, scrape, triton_backend, wait_until

pytestmark = pytest.mark.triton
SPEC = ImageSpec()
ONE_LEVEL = 1 / 255 / min(SPEC.std)  # one step of a pixel value, in the normalised tensor


def kinds() -> dict[str, bytes]:
    rgb = photo(640, 480, seed=61)
    exif = Image.Exif()
    exif[0x0112] = 8
    return {
        "4:2:0 640x480": encode(rgb, "JPEG", quality=90),
        "4:4:4 640x427": encode(photo(640, 427, seed=62), "JPEG", quality=95, subsampling=0),
        "progressive 300x500": encode(photo(300, 500, seed=63), "JPEG", progressive=True),
        "grayscale 333x250": encode(Image.fromarray(photo(333, 250, seed=64)).convert("L"), "JPEG"),
        "EXIF orientation 8": encode(rgb, "JPEG", exif=exif.tobytes()),
        "1x1": encode(photo(1, 1, seed=65), "JPEG"),
        "224x224 (no resize)": encode(photo(224, 224, seed=66), "JPEG"),
        "2000x1500": encode(photo(2000, 1500, seed=67), "JPEG", quality=80),
    }


def decode_step(client: Any, data: bytes, model: str = "resnet50_decode") -> np.ndarray:
    import tritonclient.http as httpclient

    from bench.agreement import bytes_input

    result = client.infer(model, [bytes_input(httpclient, "encoded", data)])
    assert result.as_numpy("readable").tolist() == [[True]]
    return result.as_numpy("decoded")


@pytest.mark.parametrize("kind", list(kinds()))
def test_the_decode_step_gives_the_legacy_tensor_within_one_pixel_level(triton_client: Any, kind: str) -> None:
    data = kinds()[kind]
    assert cpu_reason(data, SPEC) is None, "the shim forwards this kind"
    got = decode_step(triton_client, data)[0]
    want = to_tensor(decode(data, SPEC), SPEC)
    diff = np.abs(got - want)
    assert got.shape == want.shape == (3, 224, 224)
    assert diff.max() <= ONE_LEVEL * 1.001, (kind, diff.max())
    assert diff.mean() <= ONE_LEVEL * 0.05, (kind, diff.mean())  # at most 5% of the values one level off


def encoded_backend(triton: EmbeddedTriton, repo: Path) -> TritonBackend:
    """The shim's own (app/wiring.py): readiness checks the decode step's parameters against the description."""
    from app.description import resolve
    from app.settings import Settings
    from app.wiring import triton_backend

    settings = Settings(triton_url=triton.http_url, model_repository=repo, transport="encoded",
                        triton_timeout_s=60)
    return triton_backend(settings, resolve(settings))


def test_the_backend_sends_uploads_as_they_came_and_a_refusal_is_the_images(triton: EmbeddedTriton,
                                                                            test_repo: Path) -> None:
    backend = encoded_backend(triton, test_repo)
    tensors = triton_backend(triton.http_url, "fp32")
    try:
        state = backend.ready()
        assert state.ready, state.detail
        assert "resnet50_encoded" in state.detail and "transport encoded" in state.detail, state.detail
        data = kinds()["4:2:0 640x480"]
        (got,) = backend.infer([backend.prepare(Upload(data, SPEC))], ["enc-1"])
        (want,) = tensors.infer([tensors.prepare(Upload(data, SPEC))], ["tensor-1"])
        assert isinstance(got, np.ndarray) and got.shape == (1000,)
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), np.abs(got - want).max()
        at = data.find(b"\xff\xc4")  # a bogus Huffman table: only the decoder can tell (a cut JPEG: the sniff)
        bogus = data[:at + 4] + b"\x00" + b"\xff" * 16 + data[at + 21:]
        (refused,) = backend.infer([backend.prepare(Upload(bogus, SPEC))], ["enc-2"])
        assert isinstance(refused, SendAgain), refused  # decoded again in the request's thread, by Pillow
        with pytest.raises(InvalidImage):  # which cannot read it either: legacy's 400
            refused.make()
        assert backend.ready().ready  # a refused image is no failure of Triton's
    finally:
        backend.close()
        tensors.close()


@pytest.fixture(scope="module")
def encoded_flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shim-encoded-flag") / "traffic.json"


@pytest.fixture(scope="module")
def shim_encoded(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path, encoded_flag: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """The shim in triton mode with the encoded transport (the shadow test switches it with shim-traffic)."""
    served = start_shim(tmp_path_factory.mktemp("shim-encoded"), triton_url=triton.http_url, repo=test_repo,
                        model_pt=test_model_pt, mode="triton", transport="encoded", flag_file=encoded_flag,
                        workers=1)
    yield served.wait("/readyz")
    stop_soon(served)


def metric(url: str, name: str, **labels: str) -> float:
    return sum(s.value for s in scrape(url + "/metrics") if s.matches(name, labels))


def triton_count(triton: EmbeddedTriton, model: str, name: str = "nv_inference_count") -> float:
    return sum(s.value for s in scrape(triton.metrics_url) if s.matches(name, {"model": model}))


FAILURE_MODELS = ("resnet50_encoded", "resnet50_decode")


def post(url: str, data: bytes) -> requests.Response:
    return requests.post(url + "/predict", files={"image": ("upload.jpg", data)}, timeout=120)


def test_one_corrupt_upload_among_fifteen_good_ones_fails_alone(shim_encoded: ServedApp, shim_triton: ServedApp,
                                                                triton: EmbeddedTriton) -> None:
    readyz = requests.get(shim_encoded.url + "/readyz", timeout=10).json()
    assert readyz["transport"] == "encoded", readyz
    good = [encode(photo(640, 480, seed=100 + i), "JPEG", quality=90) for i in range(15)]
    at = good[0].find(b"\xff\xc4")  # a bogus Huffman table: the header is fine, only the decoder can tell
    truncated = good[0][:at + 4] + b"\x00" + b"\xff" * 16 + good[0][at + 21:]
    refused_before = metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="decoder_refused")
    sent_before = triton_count(triton, "resnet50_encoded")
    failed_before = {m: triton_count(triton, m, "nv_inference_request_failure") for m in FAILURE_MODELS}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda d: post(shim_encoded.url, d), [truncated, *good]))
    assert [a.status_code for a in answers] == [400] + [200] * 15, [a.text[:200] for a in answers]
    assert all(a.headers["X-Shim-Backend"] == "triton" for a in answers[1:])
    legacy_answer = post(shim_triton.url, truncated)  # the shim with tensors, as the legacy app answers
    assert answers[0].json() == legacy_answer.json(), (answers[0].json(), legacy_answer.json())
    assert answers[0].json()["error"] == "invalid_image"
    assert metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="decoder_refused") == refused_before + 1
    assert triton_count(triton, "resnet50_encoded") - sent_before == 16  # the corrupt one too: `readable` false
    # A client's corrupt upload is no failure of Triton's: TritonInferenceFailures (deploy/prometheus) stays quiet.
    assert {m: triton_count(triton, m, "nv_inference_request_failure") for m in FAILURE_MODELS} == failed_before
    tensors = [post(shim_triton.url, d).json()["predictions"][0]["class_id"] for d in good]
    assert sum(a.json()["predictions"][0]["class_id"] == t for a, t in zip(answers[1:], tensors, strict=True)) >= 14


def test_jpegs_cut_short_take_the_cpu_path_with_the_legacy_answer(shim_encoded: ServedApp, shim_triton: ServedApp,
                                                                 triton: EmbeddedTriton) -> None:
    """A GPU decoder may fill in what Pillow refuses: such uploads never reach Triton, nor count as its failures."""
    jpeg = encode(photo(640, 480, seed=9), "JPEG", quality=90)
    no_scan = jpeg[: jpeg.find(b"\xff\xda")] + b"\xff\xd9"
    cut = [jpeg[: len(jpeg) // 2], jpeg[: len(jpeg) * 95 // 100], jpeg[:-2], no_scan]
    before = metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="incomplete")
    failures = sum(s.value for s in scrape(triton.metrics_url) if s.matches("nv_inference_request_failure", {}))
    for data in cut:
        got, legacy = post(shim_encoded.url, data), post(shim_triton.url, data)
        assert (got.status_code, got.json()) == (legacy.status_code, legacy.json()), got.text[:300]
    assert metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="incomplete") == before + len(cut)
    assert sum(s.value for s in scrape(triton.metrics_url)
               if s.matches("nv_inference_request_failure", {})) == failures


def test_other_kinds_take_the_shims_cpu_path_and_answer_as_before(shim_encoded: ServedApp,
                                                                  shim_triton: ServedApp) -> None:
    png = encode(photo(400, 300, seed=7), "PNG")
    cmyk = encode(Image.fromarray(photo(300, 200, seed=8)).convert("CMYK"), "JPEG")
    before = {r: metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason=r) for r in ("format", "jpeg_mode")}
    for data in (png, cmyk):
        got, want = post(shim_encoded.url, data), post(shim_triton.url, data)
        assert got.status_code == want.status_code == 200
        assert got.json()["predictions"][0] == want.json()["predictions"][0]  # the same tensor, the same model
    assert metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="format") == before["format"] + 1
    assert metric(shim_encoded.url, "shim_encoded_cpu_path_total", reason="jpeg_mode") == before["jpeg_mode"] + 1


def test_shadow_mode_compares_the_encoded_path_with_legacy(shim_encoded: ServedApp, triton: EmbeddedTriton,
                                                           encoded_flag: Path, test_repo: Path) -> None:
    shim_traffic(encoded_flag, test_repo, "set", "shadow", "--shadow-percent", "100")
    wait_until(lambda: requests.get(shim_encoded.url + "/traffic", timeout=10).json()["mode"] == "shadow", 30,
               "shadow mode in the shim's one worker")

    def compared() -> float:
        return sum(metric(shim_encoded.url, "shim_shadow_comparisons_total", result=r) for r in ("match", "mismatch"))

    before, sent_before = compared(), triton_count(triton, "resnet50_encoded")
    errors = metric(shim_encoded.url, "shim_shadow_comparisons_total", result="error")
    for i in range(4):
        answer = post(shim_encoded.url, encode(photo(320, 240, seed=200 + i), "JPEG"))
        assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == "legacy"
    wait_until(lambda: compared() >= before + 4, 60, "four shadow comparisons")
    assert triton_count(triton, "resnet50_encoded") - sent_before == 4  # the shadow calls sent the uploads
    assert metric(shim_encoded.url, "shim_shadow_comparisons_total", result="error") == errors
    shim_traffic(encoded_flag, test_repo, "set", "triton")
