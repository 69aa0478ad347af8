"""The fast multipart path gives what werkzeug's parser gives, for every body, odd or broken."""

from __future__ import annotations

import numpy as np
import pytest
from urllib3 import encode_multipart_formdata

from app import uploads
from app.errors import MissingImage, TooLarge
from tests.support import mutated

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

PHOTO = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n" + b"\xff\xd8" * 100
LIMITS = {"max_parts": 1000, "max_field_bytes": 500_000}


def fast_and_werkzeug(body: bytes, content_type: str) -> tuple[object, object]:
    """What each parser makes of a body: the image bytes, None (no image) or the exception's type."""
    def outcome(parse: object) -> object:
        try:
            return parse()  # type: ignore[operator]
        except MissingImage:
            return None
        except Exception as e:
            return type(e).__name__

    fast = outcome(lambda: uploads.image_from_form(body, content_type, "image", **LIMITS))
    reference = outcome(lambda: uploads._werkzeug(body, content_type, "image", 1000, 500_000))
    return fast, reference


def encode(fields: list[tuple[str, object]], boundary: str = "b0undary") -> tuple[bytes, str]:
    return encode_multipart_formdata(fields, boundary=boundary)


BODIES = {
    "requests-style": encode([("image", ("photo.jpg", PHOTO, "image/jpeg"))]),
    "field first": encode([("note", "hello"), ("image", ("p.jpg", PHOTO))]),
    "two images": encode([("image", ("a.jpg", PHOTO)), ("image", ("b.jpg", b"second"))]),
    "not a file": encode([("image", "just text")]),
    "empty filename": encode([("image", ("", b""))]),
    "unicode filename": encode([("image", ("\u00e9\U0001f600.jpg", PHOTO))]),
    "quoted boundary": (encode([("image", ("p.jpg", PHOTO))], "q b")[0], 'multipart/form-data; boundary="q b"'),
    "preamble and epilogue": (b"preamble\r\n" + encode([("image", ("p.jpg", PHOTO))])[0] + b"epilogue",
                              "multipart/form-data; boundary=b0undary"),
    "LF line ends": (encode([("image", ("p.jpg", b"abc"))])[0].replace(b"\r\n", b"\n"),
                     "multipart/form-data; boundary=b0undary"),
    "base64 part": (b"--x\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n"
                    b"Content-Transfer-Encoding: base64\r\n\r\naGVsbG8=\r\n--x--\r\n",
                    "multipart/form-data; boundary=x"),
    "unterminated": (b"--x\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\nabc",
                     "multipart/form-data; boundary=x"),
    "no headers end": (b"--x\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\nabc\r\n--x--",
                       "multipart/form-data; boundary=x"),
}


@pytest.mark.parametrize("name", BODIES)
def test_the_fast_path_answers_as_werkzeug_does(name: str) -> None:
    body, content_type = BODIES[name]
    fast, reference = fast_and_werkzeug(body, content_type)
    assert fast == reference, (name, fast, reference)


def test_the_photo_comes_out_whole_and_not_a_copy_of_its_neighbours() -> None:
    body, content_type = BODIES["field first"]
    assert uploads.image_from_form(body, content_type, "image", **LIMITS) == PHOTO


def test_broken_bodies_answer_as_werkzeug_does() -> None:
    """Seeded mutations of real bodies: cut, bytes flipped, CRLFs removed, boundaries doubled."""
    rng = np.random.default_rng(1234)
    sources = [BODIES[n] for n in ("requests-style", "field first", "two images", "preamble and epilogue")]
    checked = 0
    for _ in range(600):
        body, content_type = sources[int(rng.integers(len(sources)))]
        data = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            kind, at = int(rng.integers(4)), int(rng.integers(max(1, len(data))))
            if kind == 0:
                del data[at:]
            elif kind == 1:
                data[at] = int(rng.integers(256))
            elif kind == 2:
                data[:] = data.replace(b"\r\n", b"\n", 1)
            else:
                data[at:at] = b"\r\n--b0undary\r\n"
        fast, reference = fast_and_werkzeug(bytes(data), content_type)
        assert fast == reference, (bytes(data)[:200], fast, reference)
        checked += 1
    assert checked == 600


def test_too_many_parts_and_too_large_fields_are_refused_by_both() -> None:
    body, content_type = encode([(f"f{i}", "x") for i in range(1001)] + [("image", ("p.jpg", PHOTO))])
    with pytest.raises(TooLarge, match="more than 1,000 form parts"):
        uploads.image_from_form(body, content_type, "image", **LIMITS)
    body, content_type = encode([("note", "x" * 600_000), ("image", ("p.jpg", PHOTO))])
    with pytest.raises(TooLarge, match="over 500,000 bytes"):
        uploads.image_from_form(body, content_type, "image", **LIMITS)


def test_a_body_that_is_not_a_form_has_no_image() -> None:
    with pytest.raises(MissingImage):
        uploads.image_from_form(b'{"image": "x"}', "application/json", "image", **LIMITS)
    with pytest.raises(MissingImage):
        uploads.image_from_form(PHOTO, "multipart/form-data", "image", **LIMITS)  # no boundary


def test_a_delimiter_right_after_the_headers_answers_as_werkzeug_does() -> None:
    for body in (b"--x\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\n--x--\r\n",
                 b"--x\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\n\r\n--x--\r\n"):
        fast, reference = fast_and_werkzeug(body, "multipart/form-data; boundary=x")
        assert fast == reference, (body, fast, reference)


def test_a_delimiter_after_a_lone_lf_or_cr_inside_a_part_answers_as_werkzeug_does() -> None:
    """werkzeug ends a part at a delimiter after any line break; the fast path once took it as the part's data
    (a different image, or none, from the legacy app's)."""
    for lone in (b"\n", b"\r"):
        body, content_type = encode([("image", ("a.jpg", PHOTO + lone + b"--b0undary\r\nX: y\r\n\r\nrest")),
                                     ("image", ("b.jpg", b"second"))])
        fast, reference = fast_and_werkzeug(body, content_type)
        assert fast == reference, (lone, fast if not isinstance(fast, bytes) else len(fast))


def test_mutated_bodies_answer_as_werkzeug_does() -> None:
    """Seeded mutations of well-formed bodies, weighted to the bytes multipart is made of: the same image (or none,
    or the same refusal) either way. This seed found the lone-LF delimiters above."""
    import random

    rng = random.Random(1)
    seeds = [encode(fields)[0] for fields in (
        [("image", ("a.jpg", PHOTO[:300], "image/jpeg"))],
        [("note", "hello"), ("image", ("a.jpg", PHOTO[:300]))],
        [("image", ("a.jpg", PHOTO[:300])), ("image", ("b.jpg", PHOTO[300:600]))])]
    pieces = [b"\r\n", b"\n", b"\r", b"--", b"--b0undary", b"\r\n--b0undary\r\n", b'"', b";", b"filename="]
    differ = []
    for body in mutated(rng, seeds, 5000, edits=4, cut=8, inserted=lambda: rng.choice(pieces),
                        new_byte=lambda: rng.choice([13, 10, 45, 34, 59, 61, 58, 32, rng.randrange(256)])):
        fast, reference = fast_and_werkzeug(body, "multipart/form-data; boundary=b0undary")
        if fast != reference:
            differ.append(body)
    assert not differ, differ[:2]
