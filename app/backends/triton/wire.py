"""Triton's infer call on one plain keep-alive HTTP/1.1 socket per thread: tritonclient builds the request body and
parses the answer (its own generate_request_body / parse_response_body); this only moves the bytes.

Why: tritonclient's geventhttpclient and the standard library's http.client each spend about 0.3 ms of CPU per
call on headers and buffering, more than the request's build, the answer's parse and the socket's own system calls
together (bench/RESULTS.md, "The Triton call on its own socket"). Everything else (metadata, config, readiness) stays on
tritonclient's client.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping

from tritonclient.utils import InferenceServerException

HEAD_LIMIT = 64 * 1024  # an answer's status line and headers; Triton's are a few hundred bytes
READ_SIZE = 256 * 1024


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout (Triton not listening, or the host unreachable)."""


class Wire:
    def __init__(self, host: str, port: int, *, connect_timeout_s: float, network_timeout_s: float) -> None:
        self._address = (host, port)
        self._host_header = f"Host: {host}:{port}\r\n"
        self._connect_timeout_s = connect_timeout_s
        self._network_timeout_s = network_timeout_s
        self._sock: socket.socket | None = None

    def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[dict[str, str], bytes]:
        """The answer's headers (lower-case names) and body for a 200; any other status raises tritonclient's
        InferenceServerException with Triton's error text, as tritonclient's own infer() does."""
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {path} HTTP/1.1\r\n{self._host_header}Content-Length: {len(body)}\r\n{head}\r\n").encode()
        reused = self._sock is not None
        try:
            status, answer, data = self._exchange(request, body)
        except _ClosedEarly:
            if not reused:
                raise
            # A kept-alive connection the server closed while idle: nothing of this request was read, so it goes
            # once more on a new one (as geventhttpclient and urllib3 do).
            status, answer, data = self._exchange(request, body)
        if answer.get("connection", "").lower() == "close":
            self.close()
        if status != 200:
            raise _error(status, data)
        return answer, data

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _exchange(self, request: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
        try:
            self._send(request, body)
            return self._receive()
        except BaseException:
            self.close()  # a timeout or a broken answer leaves the connection's state unknown
            raise

    def _connected(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection(self._address, timeout=self._connect_timeout_s)
            except TimeoutError as e:
                raise ConnectTimeout(f"no connection to {self._address[0]}:{self._address[1]} within "
                                     f"{self._connect_timeout_s:g} s") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._network_timeout_s)
            self._sock = sock
        return self._sock

    def _send(self, request: bytes, body: bytes) -> None:
        sock = self._connected()
        parts = [memoryview(request), memoryview(body)]
        while parts:  # one system call for head and body where the kernel takes both
            try:
                sent = sock.sendmsg(parts)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise _ClosedEarly("Triton closed the connection before the request was sent") from e
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]

    def _receive(self) -> tuple[int, dict[str, str], bytes]:
        sock = self._connected()
        data, end = b"", -1
        while end < 0:
            if len(data) > HEAD_LIMIT:
                raise ConnectionError(f"Triton's answer has no end of headers in its first {HEAD_LIMIT} bytes")
            try:
                chunk = sock.recv(READ_SIZE)
            except ConnectionResetError as e:
                if data:
                    raise
                raise _ClosedEarly("Triton reset the connection before answering") from e
            if not chunk:
                if data:
                    raise ConnectionError("Triton closed the connection mid-answer")
                raise _ClosedEarly("Triton closed the connection before answering")
            data += chunk
            end = data.find(b"\r\n\r\n", max(0, len(data) - len(chunk) - 3))
        status, headers = _head(data[:end])
        if "content-length" not in headers:
            raise ConnectionError(f"Triton answered {status} without a Content-Length")
        length = int(headers["content-length"])
        if len(data) > end + 4 + length:
            raise ConnectionError("Triton sent more than its answer's Content-Length")
        body = bytearray(length)
        got = len(data) - end - 4
        body[:got] = data[end + 4:]
        view = memoryview(body)
        while got < length:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("Triton closed the connection mid-answer")
            got += n
        return status, headers, bytes(body)


class _ClosedEarly(ConnectionError):
    """The server closed the connection before the first byte of the answer."""


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"Triton answered no HTTP status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _error(status: int, data: bytes) -> InferenceServerException:
    """What tritonclient raises for a non-200 answer: Triton's own error text and the status."""
    try:
        text = json.loads(data)["error"] if data else "client received an empty response from the server."
    except (ValueError, KeyError, TypeError):
        text = f"an exception occurred in the client while decoding the response: {data[:200]!r}"
    return InferenceServerException(msg=str(text), status=str(status))
