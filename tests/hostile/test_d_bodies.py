"""(d) Refused and broken uploads: 413 before a declared oversize body is sent (no 100 Continue), a chunked
body cut off at the limit and its connection closed, 400 invalid_body for a broken chunked body (never 500)
through nginx and straight to gunicorn; nginx's own answers in the contract's JSON shape."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from devstack import proxy
from devstack.launch import free_port
from devstack.waiting import wait_until
from tests.hostile.clients import RawResponse, multipart_body, read_answer, request
from tests.hostile.conftest import Figures, Stack

MIB = 1 << 20
DECLARED = 200 * MIB
CHUNKED_TOTAL = 1 << 30
PACE_BYTES_PER_S = 64 * MIB  # the chunked sender's pace: 16 s for the whole GiB, were it all read
HEAD = ("POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: hostile/1.0\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\n")


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def json_error(raw: RawResponse, status: int) -> tuple[dict[str, Any], dict[str, str]]:
    headers, body = raw.head_and_body(status)
    assert headers.get("content-type", "").startswith("application/json"), headers
    document = json.loads(body)
    assert set(document) == {"error", "message"} and document["message"], document
    return document, headers


def log_entry(front: proxy.Proxy, request_id: str) -> dict[str, Any]:
    """nginx's access log line of one request (written when the request ends)."""
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        found[:] = [e for e in front.access_log() if e.get("request_id") == request_id]
        return bool(found)

    wait_until(logged, 10, f"nginx's access log line of {request_id}")
    return found[-1]


@pytest.mark.parametrize("expect", [True, False], ids=["expect-100-continue", "no-expect"])
def test_a_declared_oversize_upload_gets_nginx_413_before_its_body_is_sent(healthy: Stack, figures: Figures,
                                                                           expect: bool) -> None:
    stack = healthy
    label = "Content-Length 200 MB" + (" + Expect: 100-continue" if expect else "")
    answers: dict[str, RawResponse] = {}
    for target, port in [("nginx", stack.proxy_port), ("gunicorn", stack.shim_port)]:
        request_id = f"hostile-declared-{int(expect)}-{target}"
        head = (HEAD + f"Content-Length: {DECLARED}\r\nX-Request-ID: {request_id}\r\n"
                + ("Expect: 100-continue\r\n" if expect else "") + "\r\n")
        with connect(port) as sock:
            sock.sendall(head.encode())  # the head alone: not one byte of the body
            answers[target] = read_answer(sock, 5)
        got = answers[target]
        figures.add("d oversize", f"{label}, straight to {target}" if target == "gunicorn" else f"{label}, via nginx",
                    f"{' then '.join(map(str, got.statuses)) or 'no answer'} after {got.seconds * 1000:.0f} ms, "
                    "no body byte sent")
    raw = answers["nginx"]
    assert raw.statuses == [413], f"nginx must answer 413 at once, and no 100 Continue: {raw.data[:300]!r}"
    document, headers = json_error(raw, 413)
    assert document["error"] == "too_large", document
    assert headers.get("connection") == "close"
    assert headers.get("x-request-id") == f"hostile-declared-{int(expect)}-nginx"
    assert raw.seconds < 1.0, f"the 413 took {raw.seconds:.2f} s"
    entry = log_entry(stack.proxy, f"hostile-declared-{int(expect)}-nginx")
    assert (entry["status"], entry["upstream"]) == (413, ""), f"the request reached gunicorn: {entry}"
    # Straight to gunicorn (`make run`, no proxy): the app refuses the declared size too (app/bodies.py), but
    # gunicorn has sent "100 Continue" before the app runs, so a client may start sending the 200 MB.
    assert answers["gunicorn"].statuses[-1:] == [413], answers["gunicorn"].data[:300]


def test_a_chunked_upload_is_cut_off_at_the_limit_and_its_connection_closed(healthy: Stack, figures: Figures) -> None:
    stack = healthy
    limit = stack.settings.max_upload_bytes
    results = {target: send_chunked(port, f"hostile-chunked-{target}")
               for target, port in [("nginx", stack.proxy_port), ("gunicorn", stack.shim_port)]}
    for target, r in results.items():
        place = "via nginx" if target == "nginx" else "straight to gunicorn"
        figures.add("d oversize", f"chunked 1 GiB at {PACE_BYTES_PER_S // MIB} MiB/s, {place}",
                    f"{r['status']} after {r['sent_at_answer'] / MIB:.1f} MiB ({r['answer_s']:.2f} s); connection "
                    f"closed {r['closed_s'] - r['answer_s']:.2f} s later, {r['sent'] / MIB:.0f} MiB sent in all")
    r = results["nginx"]
    assert r["status"] == 413 and r["error"] == "too_large", r
    assert r["sent_at_answer"] <= limit + 8 * MIB, f"the 413 came only after {r['sent_at_answer'] / MIB:.1f} MiB"
    assert r["closed_s"] is not None, "nginx never closed the connection while the client kept sending"
    assert r["closed_s"] - r["answer_s"] <= 1.0, f"closed {r['closed_s'] - r['answer_s']:.1f} s after the 413"
    assert r["sent"] <= r["sent_at_answer"] + 16 * MIB, f"nginx took {r['sent'] / MIB:.0f} MiB in all"
    entry = log_entry(stack.proxy, "hostile-chunked-nginx")
    assert (entry["status"], entry["upstream"]) == (413, ""), f"the body reached gunicorn: {entry}"
    assert results["gunicorn"]["status"] == 413, results["gunicorn"]  # the app's own limit, for the record


def send_chunked(port: int, request_id: str) -> dict[str, Any]:
    """Send a 1 GiB chunked body at PACE_BYTES_PER_S while reading: when the answer came, when sending failed."""
    chunk = b"x" * (64 * 1024)
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    state: dict[str, Any] = {"status": None, "error": None, "answer_s": None, "sent_at_answer": None,
                             "closed_s": None, "sent": 0}
    with connect(port) as sock:
        sock.sendall((HEAD + f"Transfer-Encoding: chunked\r\nX-Request-ID: {request_id}\r\n\r\n").encode())
        started = time.monotonic()

        def read() -> None:
            raw = read_answer(sock, 60)
            state["answer_s"], state["sent_at_answer"] = time.monotonic() - started, state["sent"]
            if raw.statuses:
                state["status"] = raw.statuses[-1]
                state["error"] = json_error(raw, raw.statuses[-1])[0]["error"]

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while state["sent"] < CHUNKED_TOTAL and time.monotonic() - started < 40:
                sock.sendall(frame)
                state["sent"] += len(chunk)
                ahead = state["sent"] / PACE_BYTES_PER_S - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        except OSError:  # EPIPE / ECONNRESET: the server closed the connection
            state["closed_s"] = time.monotonic() - started
        reader.join(timeout=30)
    return state


BROKEN_CHUNKED = {
    "bad chunk size": b"5\r\nhello\r\nZZZ\r\nxx\r\n0\r\n\r\n",
    "no CRLF after the data": b"5\r\nhelloXX5\r\nhello\r\n0\r\n\r\n",
    "chunk size overflows": b"fffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
}


# gunicorn takes a chunk size of 2^84 bytes and waits for them: the request holds a thread until the client leaves,
# with no answer (never a 500); only the proxy refuses it.
GUNICORN_WAITS = "chunk size overflows"


@pytest.mark.parametrize(("kind", "target"), [
    *[(kind, "nginx") for kind in BROKEN_CHUNKED],
    *[(kind, "gunicorn") for kind in BROKEN_CHUNKED],
])
def test_a_broken_chunked_body_gets_400_invalid_body_never_500(healthy: Stack, figures: Figures, target: str,
                                                               kind: str) -> None:
    stack = healthy
    port = stack.proxy_port if target == "nginx" else stack.shim_port
    with connect(port) as sock:
        sock.sendall((HEAD + "Transfer-Encoding: chunked\r\n\r\n").encode() + BROKEN_CHUNKED[kind])
        raw = read_answer(sock, 10)
    figures.add("d broken body", f"{kind}, {'via nginx' if target == 'nginx' else 'straight to gunicorn'}",
                f"{raw.statuses} {raw.head_and_body(raw.statuses[-1])[1][:60]!r}" if raw.statuses else "no answer")
    if target == "gunicorn" and kind == GUNICORN_WAITS:
        assert raw.statuses in ([], [400]), raw.data[:400]  # no answer while it waits; never a 500
        assert requests_ok(stack), "the shim stopped answering after a broken body"
        return
    assert raw.statuses == [400], raw.data[:400]
    document, _ = json_error(raw, 400)
    assert document["error"] == "invalid_body", document
    assert requests_ok(stack), "the shim stopped answering after a broken body"


def requests_ok(stack: Stack) -> bool:
    return request(stack.proxy_port, "GET", "/healthz").status == 200


def test_an_ordinary_upload_with_expect_100_continue_is_served(healthy: Stack) -> None:
    """nginx answers the Expect itself and does not pass it on: the shim gets a plain buffered request."""
    body, content_type = multipart_body(healthy.image)
    with connect(healthy.proxy_port) as sock:
        sock.sendall((f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                      f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode())
        first = read_answer(sock, 1)  # nothing final comes before the body: it reads for the whole second
        assert first.statuses == [100] and first.data == b"HTTP/1.1 100 Continue\r\n\r\n", first.data[:200]
        sock.sendall(body)
        raw = read_answer(sock, 30)
    assert raw.statuses[-1:] == [200], raw.data[:300]
    headers, answer = raw.head_and_body(200)
    assert json.loads(answer)["predictions"] and headers.get("x-shim-backend") == "triton"


def test_nginx_answers_for_an_unreachable_shim_in_the_contracts_shape(tmp_path: Path) -> None:
    """A second nginx in front of a port where nothing listens: what clients and probes see when gunicorn
    is down. /predict and /readyz: 503 backend_unavailable with Retry-After; nginx's own liveness: 200."""
    front = proxy.Proxy(tmp_path / "nginx", f"127.0.0.1:{free_port()}").wait()
    try:
        predict = request(front.port, "POST", "/predict", body=b"x", headers={"Content-Type": "multipart/form-data; "
                                                                              "boundary=x", "X-Request-ID": "abc.1"})
        ready = request(front.port, "GET", "/readyz")
        alive = request(front.port, "GET", proxy.LIVENESS)
    finally:
        front.stop()
    for answer in (predict, ready):
        assert answer.status == 503, answer
        assert answer.headers["content-type"].startswith("application/json") and answer.headers["retry-after"]
        assert json.loads(answer.body)["error"] == "backend_unavailable"
    assert predict.headers["x-request-id"] == "abc.1"
    assert alive.status == 200 and json.loads(alive.body) == {"status": "ok"}
    assert "server" not in predict.headers or predict.headers["server"] == "nginx"  # server_tokens off: no version


def test_every_access_log_line_is_one_json_object(stack: Stack) -> None:
    """Run last: every line nginx logged during the suite parses, with the fields operators filter on."""
    lines = stack.proxy.access_log_path.read_text().splitlines()
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert {"ts", "level", "logger", "message", "request_id", "status", "client", "upstream",
                "request_time_s"} <= set(entry), entry
