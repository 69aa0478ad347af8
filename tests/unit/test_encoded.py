"""The encoded transport above the seam: which uploads are forwarded as they came, and that every answer
stays the legacy contract's (the real decoder in Triton: tests/integration/test_encoded.py)."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app import create_app, images, metrics
from app.preprocess import ImageSpec
from app.settings import Mode, Settings
from app.sniff import cpu_reason
from tests.fakes import EchoBackend, EncodedEcho, write_model_repo
from tests.support import encode, photo
from tests.unit.test_api import post_multipart, send
from tests.uploads import animated_gif, bad_uploads, png_header_only, valid_uploads

RGB = photo(320, 240, seed=21)
JPEG = encode(RGB, "JPEG", quality=90)


def exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    return encode(RGB, "JPEG", exif=exif.tobytes())


def exif_thumbnail() -> bytes:
    """A JPEG whose APP1 segment holds a whole small JPEG (its own EOI before the main scan)."""
    thumb = encode(photo(16, 12, seed=3), "JPEG")
    app1 = b"Exif\x00\x00" + thumb
    return JPEG[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + JPEG[2:]


def bad_huffman_table() -> bytes:
    """A JPEG whose header Pillow opens and whose decoder then refuses (a bogus Huffman table): the sniff cannot
    tell, so Triton's decoder is the one that refuses it."""
    at = JPEG.find(b"\xff\xc4")
    return JPEG[:at + 4] + b"\x00" + b"\xff" * 16 + JPEG[at + 21:]


@pytest.mark.parametrize(("name", "data", "reason"), [
    ("baseline 4:2:0 JPEG", JPEG, None),
    ("4:4:4 JPEG", encode(RGB, "JPEG", subsampling=0), None),
    ("progressive JPEG", encode(RGB, "JPEG", progressive=True), None),
    ("grayscale JPEG", encode(Image.fromarray(RGB).convert("L"), "JPEG"), None),
    ("EXIF-rotated JPEG (sent as it came: the decoder ignores the tag, as the legacy app did)", exif_rotated(), None),
    ("1x1 JPEG", encode(photo(1, 1), "JPEG"), None),
    ("CMYK JPEG", encode(Image.fromarray(RGB).convert("CMYK"), "JPEG"), "jpeg_mode"),
    ("PNG", encode(RGB, "PNG"), "format"),
    ("WebP", encode(RGB, "WEBP"), "format"),
    ("animated GIF", animated_gif(), "format"),
    ("PNG bomb header (Pillow refuses it at open: 413)", png_header_only(30_000, 30_000), "unreadable"),
    ("empty", b"", "unreadable"),
    ("text", b"this is not an image\n" * 20, "unreadable"),
    ("a JPEG's first 100 bytes", JPEG[:100], "unreadable"),
    ("a JPEG cut at 50 %", JPEG[: len(JPEG) // 2], "incomplete"),
    ("a JPEG cut at 95 %", JPEG[: len(JPEG) * 95 // 100], "incomplete"),
    ("a JPEG without its EOI", JPEG[:-2], "incomplete"),
    ("a JPEG with no scan", JPEG[: JPEG.find(b"\xff\xda")] + b"\xff\xd9", "incomplete"),
    ("a progressive JPEG cut at 95 %", encode(RGB, "JPEG", progressive=True)[:-200], "incomplete"),
    ("a JPEG with bytes after its EOI (Pillow reads it)", JPEG + b"trailer", None),
    ("a truncated JPEG whose EXIF thumbnail ends with EOI", exif_thumbnail()[:-600], "incomplete"),
])
def test_only_rgb_and_grayscale_jpegs_are_forwarded(name: str, data: bytes, reason: str | None) -> None:
    assert cpu_reason(data, ImageSpec()) == reason, name


def test_jpegs_over_the_pixel_limits_stay_in_the_shim_which_answers_413() -> None:
    spec = ImageSpec(max_pixels=100_000)
    assert cpu_reason(encode(photo(400, 300), "JPEG"), spec) == "limits"  # 120,000 pixels
    assert cpu_reason(encode(photo(300, 10), "JPEG"), spec) == "limits"  # resizes to 7680 x 256
    assert cpu_reason(encode(photo(300, 200), "JPEG"), spec) is None
    # max_size (a model's own): the resize the decode step would do, as app.preprocess.crop computes it
    capped = ImageSpec(resize=160, crop=150, max_size=180)
    assert cpu_reason(encode(photo(4000, 3), "JPEG"), capped) == "limits"  # the short side resizes to 0 px
    assert cpu_reason(encode(photo(4000, 30), "JPEG"), capped) is None  # 180 x 1


def test_the_decode_steps_served_parameters_are_checked_both_ways() -> None:
    from app.backends.triton.checks import check_parameters, decode_step_of
    from app.errors import ModelMismatch

    wanted = {"resize": "256", "interpolation": "bilinear"}

    def config(**params: str) -> dict[str, Any]:
        return {"parameters": {k: {"string_value": v} for k, v in params.items()}}

    check_parameters(config(**wanted), wanted, where="step", every=True)
    with pytest.raises(ModelMismatch, match=r"step was generated from another description: interpolation='bicubic', "
                                            r"the shim's description says 'bilinear'; max_size='300', which the "
                                            r"shim's description does not set\. Regenerate"):
        check_parameters(config(resize="256", interpolation="bicubic", max_size="300"), wanted, where="step",
                          every=True)
    with pytest.raises(ModelMismatch, match=r"interpolation not served, the shim's description says 'bilinear'"):
        check_parameters(config(resize="256"), wanted, where="step", every=True)
    check_parameters(config(resize="256"), wanted, where="model")  # the model's own: only what it serves

    def ensemble(*steps: str) -> dict[str, Any]:
        return {"ensemble_scheduling": {"step": [{"model_name": name} for name in steps]}}

    assert decode_step_of(ensemble("m_decode", "m"), model="m", where="e") == "m_decode"
    with pytest.raises(ModelMismatch, match=r"e runs m_decode -> other; the encoded transport needs a decode step -> "
                                            r"m, the model the shim serves"):
        decode_step_of(ensemble("m_decode", "other"), model="m", where="e")


class Apps:
    """The same shim twice, in-process: the encoded transport (a fake of its kind) and a tensor one."""

    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        base = {"model_repository": write_model_repo(tmp_path / "repo"), "batch_delay_ms": 0.0, **settings}
        self.triton, self.legacy = EncodedEcho("triton"), EchoBackend("legacy")
        self.encoded = create_app(Settings(**base, flag_file=tmp_path / "a.json"),
                                  backends={"triton": self.triton, "legacy": self.legacy})
        self.tensors = create_app(Settings(**base, flag_file=tmp_path / "b.json"),
                                  backends={"triton": EchoBackend("triton"), "legacy": EchoBackend("legacy")})

    def predict(self, data: bytes, which: str = "encoded") -> Any:
        app = self.encoded if which == "encoded" else self.tensors
        return post_multipart(app.test_client(), {"image": (io.BytesIO(data), "photo.jpg")})

    def close(self) -> None:
        for app in (self.encoded, self.tensors):
            app.extensions["shim"].close()


@pytest.fixture
def apps(tmp_path: Path) -> Iterator[Apps]:
    made = Apps(tmp_path)
    yield made
    made.close()


def cpu_path(reason: str) -> float:
    return metrics.ENCODED_CPU_PATH.labels(reason)._value.get()


def test_a_jpeg_goes_to_triton_as_its_own_bytes_and_a_png_as_a_tensor(apps: Apps) -> None:
    before = cpu_path("format")
    answer = apps.predict(JPEG)
    assert answer.status_code == 200, answer.get_json()
    assert apps.triton.uploads == [JPEG] and apps.triton.tensors == 0
    assert answer.get_json()["predictions"][0]["class_id"] == 1  # the fake's logits for an upload
    png = apps.predict(encode(RGB, "PNG"))
    assert png.status_code == 200
    assert apps.triton.uploads == [JPEG] and apps.triton.tensors == 1
    assert cpu_path("format") == before + 1


def test_every_upload_gets_the_same_status_and_body_as_with_tensors(apps: Apps) -> None:
    """The contract's 400 / 413 answers come from the same code: the CPU path decides every refusal."""
    for upload in [*bad_uploads(), *valid_uploads()]:
        if upload.status == 200:
            continue
        flask = {"encoded": apps.encoded, "tensors": apps.tensors}
        got = {k: send(app.test_client(), upload) for k, app in flask.items()}
        assert got["encoded"].status_code == got["tensors"].status_code == upload.status, upload.name
        bodies = [got[k].get_json() for k in ("encoded", "tensors")]
        if "declared" in bodies[1]["message"]:  # the body's size, which werkzeug's random boundary changes
            bodies = [b["error"] for b in bodies]
        assert bodies[0] == bodies[1], upload.name
    for upload in valid_uploads():
        assert send(apps.encoded.test_client(), upload).status_code == 200, upload.name


def test_an_upload_the_decoder_refuses_gets_the_legacy_answer(apps: Apps) -> None:
    truncated = bad_huffman_table()
    assert cpu_reason(truncated, ImageSpec()) is None  # its header is fine: only decoding finds it
    apps.triton.refuse = {truncated, JPEG}
    before = cpu_path("decoder_refused")
    bad, bad_tensors = apps.predict(truncated), apps.predict(truncated, "tensors")
    assert bad.status_code == 400 and bad.get_json() == bad_tensors.get_json()
    assert bad.get_json()["error"] == "invalid_image"
    good = apps.predict(JPEG)  # refused by the decoder, read by Pillow: answered from the shim's own tensor
    assert good.status_code == 200 and good.get_json() == apps.predict(JPEG, "tensors").get_json()
    assert cpu_path("decoder_refused") == before + 2
    assert apps.triton.tensors == 1


def test_a_refused_upload_is_decoded_in_its_own_requests_thread_never_in_the_batch_sender(
        apps: Apps, monkeypatch: pytest.MonkeyPatch) -> None:
    apps.triton.refuse = {JPEG}
    threads: list[str] = []
    real_normalize = images.normalize

    def normalize(*args: Any) -> Any:  # where the upload's tensor is made
        threads.append(threading.current_thread().name)
        return real_normalize(*args)

    monkeypatch.setattr(images, "normalize", normalize)
    assert apps.predict(JPEG).status_code == 200
    assert threads and not [name for name in threads if name.startswith("batcher-")], threads
    assert apps.triton.tensors == 1  # and its tensor went to the model


def test_incomplete_jpegs_never_reach_a_decoder_that_would_fill_them_in(apps: Apps,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """nvJPEG and the hardware decoder accept some JPEGs cut short that Pillow refuses: the sniff keeps every
    incomplete stream in the shim, whose answer is the legacy app's (400 or 200, status and body)."""
    import tests.fakes

    monkeypatch.setattr(tests.fakes, "_decodes", lambda data: True)  # a decoder that decodes whatever it gets
    cut = {"50 %": JPEG[: len(JPEG) // 2], "95 %": JPEG[: len(JPEG) * 95 // 100], "no EOI": JPEG[:-2],
           "no scan": JPEG[: JPEG.find(b"\xff\xda")] + b"\xff\xd9"}
    before = cpu_path("incomplete")
    for name, data in cut.items():
        got, legacy = apps.predict(data), apps.predict(data, "tensors")
        assert (got.status_code, got.get_json()) == (legacy.status_code, legacy.get_json()), name
    assert [apps.predict(d).status_code for d in cut.values()] == [400, 400, 200, 400]  # Pillow reads "no EOI"
    assert cpu_path("incomplete") == before + 2 * len(cut)
    assert apps.triton.uploads == []  # none was sent to the decoder


def test_fallback_decodes_a_forwarded_upload_for_legacy(tmp_path: Path) -> None:
    made = Apps(tmp_path, fallback=True)
    try:
        made.triton.down = True
        answer = made.predict(JPEG)
        assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == "legacy"
        assert made.legacy.batches == [1]
        assert made.predict(JPEG[:600]).status_code == 400  # legacy's answer to what Pillow cannot read
    finally:
        made.close()


def test_shadow_sends_triton_the_upload_as_the_encoded_transport_would(tmp_path: Path) -> None:
    made = Apps(tmp_path, mode=Mode.SHADOW)  # shadow share 100 %
    try:
        results = {r: metrics.SHADOW_COMPARISONS.labels(r)._value.get() for r in metrics.SHADOW_RESULTS}
        assert made.predict(JPEG).headers["X-Shim-Backend"] == "legacy"
        assert made.predict(encode(RGB, "PNG")).status_code == 200
        from devstack.waiting import wait_until

        def compared() -> float:
            return sum(metrics.SHADOW_COMPARISONS.labels(r)._value.get() - results[r] for r in ("match", "mismatch"))

        wait_until(lambda: compared() == 2, 10, "two shadow comparisons")
        assert made.triton.uploads == [JPEG] and made.triton.tensors == 1
    finally:
        made.close()


def test_the_bytes_forwarded_are_the_upload_itself(apps: Apps) -> None:
    rng = np.random.default_rng(3)
    uploads = [encode(photo(64 + i, 48, seed=int(rng.integers(1000))), "JPEG") for i in range(5)]
    for data in uploads:
        assert apps.predict(data).status_code == 200
    assert apps.triton.uploads == uploads
