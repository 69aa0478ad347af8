"""Bad input gets a 4xx in the contract's shape, never a 5xx, and the shim keeps answering."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from tests.conftest import ServedApp
from tests.support import encode, photo
from tests.uploads import Upload, bad_uploads, png_header_only

pytestmark = pytest.mark.triton


def nasty_uploads() -> list[Upload]:
    rng = np.random.default_rng(7)
    jpeg = encode(photo(320, 240, seed=1), "JPEG")
    return [
        *bad_uploads(),
        Upload("64 MiB upload", 413, files={"image": ("huge.jpg", b"\0" * (64 * 1024 * 1024))}),
        Upload("jpeg header then noise", 400, files={"image": ("x.jpg", jpeg[:200] + rng.bytes(5000))}),
        Upload("bomb just over the limit", 413, files={"image": ("b.png", png_header_only(8000, 5001))}),
        Upload("1x100000 strip", 413, files={"image": ("strip.png", encode(np.zeros((1, 100_000, 3), np.uint8),
                                                                             "PNG"))}),
        Upload("form field, not a file", 400, kwargs={"data": {"image": "not a file"}}),
        Upload("raw jpeg body", 400, kwargs={"data": jpeg, "headers": {"Content-Type": "image/jpeg"}}),
        Upload("broken multipart", 400, kwargs={
            "data": b"--xyz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\nabc",
            "headers": {"Content-Type": "multipart/form-data; boundary=xyz"}}),
        Upload("unicode filename", 400, files={"image": ("\u00e9\u00e8\U0001f600.jpg", b"not an image")}),
        Upload("PUT", 405, method="PUT", files={"image": ("a.jpg", jpeg)}),
        *[Upload(f"fuzz {i}", 400, files={"image": ("f.jpg", jpeg[:rng.integers(2, 600)] +
                                                    rng.bytes(int(rng.integers(0, 3000))))}) for i in range(12)],
    ]


@pytest.mark.parametrize("connection", ["new connection each", "one keep-alive session"])
def test_bad_input_is_refused_with_a_4xx_and_the_shim_still_answers(shim_triton: ServedApp, connection: str) -> None:
    """Under real gunicorn: each refusal keeps the connection usable (or closes it cleanly, for bodies
    over the limit), and nothing escapes as a 5xx or a traceback. The answers' codes are also checked
    in-process for every backend mode in tests/unit/test_api.py."""
    shim = shim_triton
    session = requests.Session() if connection == "one keep-alive session" else None
    seen = {}
    for upload in nasty_uploads():
        try:  # a refused body must not poison the connection for the client's next request
            answer = upload.send(shim.url, session=session)
        except requests.ConnectionError as e:
            pytest.fail(f"{upload.name}: the connection broke instead of a contract answer: {e}")
        seen[upload.name] = answer.status_code
        assert 400 <= answer.status_code < 500, (upload.name, answer.status_code, answer.text)
        assert answer.status_code == upload.status, (upload.name, answer.text)
        body = answer.json()
        assert set(body) == {"error", "message"}, (upload.name, body)
    good = (session or requests).post(shim.url + "/predict", files={"image": encode(photo(640, 480), "JPEG")},
                                      timeout=60)
    assert good.status_code == 200, good.text
    assert requests.get(shim.url + "/readyz", timeout=10).status_code == 200
    assert "Traceback" not in shim.log(), "an error escaped to the log as a traceback"
    assert len(seen) == len(nasty_uploads())


def raw_exchange(shim: ServedApp, head: bytes, body_chunks: list[bytes] = (), timeout_s: float = 30) -> bytes:  # type: ignore[assignment]
    """Send `head`, read what comes back while sending `body_chunks`; return everything the server said."""
    import socket

    received = b""
    with socket.create_connection(("127.0.0.1", shim.port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed: that is the point of some of these
                break
        try:
            if body_chunks:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # closed by the server already
        try:  # until the server closes, or one whole answer is in (a kept-alive connection stays open)
            while not _one_whole_answer(received):
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        except (ConnectionResetError, TimeoutError):
            pass
    return received


def _one_whole_answer(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: the answer ends when the connection does


def status_and_body(raw: bytes) -> tuple[int, dict]:
    import json

    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body[: body.index(b"}") + 1] if b"}" in body else b"{}")


def test_a_declared_oversize_upload_gets_413_before_its_body_is_sent(shim_triton: ServedApp) -> None:
    head = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 200000000\r\n\r\n")
    status, body = status_and_body(raw_exchange(shim_triton, head))  # not one byte of the body is sent
    assert status == 413 and body["error"] == "too_large" and "200,000,000 bytes declared" in body["message"]


@pytest.mark.parametrize("chunks", [
    [b"zz\r\nhello\r\n"],  # not a chunk size
    [b"5\r\nhello"],  # a chunk that never ends
    [b"5\r\nhelloXX0\r\n\r\n"],  # no CRLF after the chunk
], ids=["bad size", "truncated", "no terminator"])
def test_a_broken_chunked_body_is_400_never_500(shim_triton: ServedApp, chunks: list[bytes]) -> None:
    for path in (b"/predict", b"/healthz"):
        method = b"POST" if path == b"/predict" else b"GET"
        head = (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        raw = raw_exchange(shim_triton, head, chunks, timeout_s=20)
        status, body = status_and_body(raw)
        assert status in ((400,) if path == b"/predict" else (200, 400)), raw[:300]
        if status == 400:
            assert body["error"] in ("invalid_body", "bad_request"), body
    assert "Traceback" not in shim_triton.log() and "internal_error" not in shim_triton.log()


def test_a_chunked_upload_over_the_limit_stops_at_the_limit(shim_triton: ServedApp) -> None:
    head = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    block = b"100000\r\n" + b"\0" * 0x100000 + b"\r\n"  # 1 MiB chunks
    raw = raw_exchange(shim_triton, head, [block] * 64, timeout_s=60)  # 64 MiB offered, the limit is 16
    status, body = status_and_body(raw)
    assert status == 413 and body["error"] == "too_large" and "went past the limit" in body["message"], raw[:300]


@pytest.mark.parametrize(("head", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /predict HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
], ids=["request line", "HTTP version", "two lengths", "folded header", "long URI", "too many headers"])
def test_a_request_gunicorn_cannot_parse_gets_the_contracts_json(shim_triton: ServedApp, head: bytes,
                                                                 status: int) -> None:
    """gunicorn answers these itself, before the app (`make run` has no nginx in front): in the contract's shape,
    not gunicorn's HTML page."""
    raw = raw_exchange(shim_triton, head, timeout_s=20)
    got, body = status_and_body(raw)
    assert got == status, raw[:300]
    assert b"\r\nContent-Type: application/json\r\n" in raw.partition(b"\r\n\r\n")[0] + b"\r\n", raw[:300]
    assert body["error"] == "bad_request" and body["message"].startswith("the request could not be read: "), body
    assert set(body) == {"error", "message"}
