"""The hostile suite's clients: raw sockets and threads, each recording when things happened (time.monotonic).

* request(): one HTTP/1.1 exchange on its own connection, from a chosen loopback address (127.0.0.0/8 is all
  loopback on Linux: attackers and normal clients come from different addresses, as on a real network).
* HealthPoller: GETs /healthz and /readyz every `interval_s` while a scenario runs, one thread per path.
* Drippers: slow connections in an asyncio loop of their own thread: request heads dripped one byte at a
  time, bodies dripped one byte at a time after a complete head, bodies that stall half way. Each slot
  reconnects after the server closes it (an attacker keeps up the pressure) and records every connection.
* The floods and the normal clients are bench/loadgen.py's generator, in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from report.percentiles import percentile as shared_percentile

HOST = "127.0.0.1"
NORMAL = "127.0.0.1"  # normal clients and probes
ATTACKERS = {"headers": "127.0.0.2", "body": "127.0.0.3", "stalled": "127.0.0.4"}
BOUNDARY = "hostileboundary5f1c"


def percentile(values: Sequence[float], q: float) -> float:
    """The project's percentile (report/percentiles.py: nearest rank; q in 0-100); nan for no values."""
    found = shared_percentile(values, q)
    return float("nan") if found is None else found


def multipart_body(data: bytes, filename: str = "test.jpg") -> tuple[bytes, str]:
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{filename}\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()
    return body, f"multipart/form-data; boundary={BOUNDARY}"


@dataclass
class Answer:
    status: int | None  # None: no answer (timeout, reset, refused)
    seconds: float
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    error: str = ""
    started: float = 0.0

    def json_error(self) -> str:
        """The contract's error code of a JSON error body ("" for anything else)."""
        try:
            document = json.loads(self.body)
        except ValueError:
            return ""
        return str(document.get("error", "")) if isinstance(document, dict) else ""


def request(port: int, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout_s: float = 5.0, source: str = NORMAL) -> Answer:
    """One request on a new connection; never raises for network errors (they are the Answer's error)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return Answer(response.status, time.monotonic() - started,
                      {k.lower(): v for k, v in response.getheaders()}, data, started=started)
    except (OSError, http.client.HTTPException) as e:
        return Answer(None, time.monotonic() - started, error=type(e).__name__, started=started)
    finally:
        conn.close()


def predict(port: int, image: bytes, *, timeout_s: float = 30.0, source: str = NORMAL) -> Answer:
    body, content_type = multipart_body(image)
    return request(port, "POST", "/predict", body=body, headers={"Content-Type": content_type},
                   timeout_s=timeout_s, source=source)


@dataclass(frozen=True)
class RawResponse:
    """What a raw socket read: the bytes of the first answer(s), and how the connection ended."""

    data: bytes
    seconds: float
    closed: str  # "" (still open), "EOF", "reset", "timeout"

    @property
    def statuses(self) -> list[int]:
        return [int(s) for s in re.findall(rb"^HTTP/1\.[01] (\d{3})", self.data, re.M)]

    def head_and_body(self, status: int) -> tuple[dict[str, str], bytes]:
        """The headers and body of the answer with this status (the last one: after any 100 Continue)."""
        start = self.data.rfind(f" {status} ".encode())
        start = self.data.rfind(b"HTTP/1.", 0, start)
        head, _, rest = self.data[start:].partition(b"\r\n\r\n")
        fields = dict(line.split(":", 1) for line in head.decode(errors="replace").split("\r\n")[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in fields.items()}
        length = int(headers.get("content-length", len(rest)))
        return headers, rest[:length]


def read_answer(sock: socket.socket, timeout_s: float, until_closed: bool = False) -> RawResponse:
    """Read what the server sends within timeout_s: the first complete answer, or up to EOF."""
    started = time.monotonic()
    data, closed = b"", ""
    sock.settimeout(0.2)
    while time.monotonic() - started < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if data and not until_closed and _complete(data):
                break
            continue
        except ConnectionResetError:
            closed = "reset"
            break
        if not chunk:
            closed = "EOF"
            break
        data += chunk
        if not until_closed and _complete(data):
            break
    else:
        closed = "timeout" if until_closed else ""
    return RawResponse(data, time.monotonic() - started, closed)


def _complete(data: bytes) -> bool:
    """A final (non-1xx) answer with its whole Content-Length body, after any 1xx answers."""
    position = 0
    while (end := data.find(b"\r\n\r\n", position)) >= 0:
        head = data[position:end]
        status = re.match(rb"HTTP/1\.[01] (\d{3})", head)
        if status is None:
            return False
        if not status.group(1).startswith(b"1"):
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            return length is None or len(data) - (end + 4) >= int(length.group(1))
        position = end + 4
    return False


class HealthPoller:
    """GET each path every interval_s (one thread per path) with a client timeout; records every answer."""

    def __init__(self, port: int, paths: Sequence[str] = ("/healthz", "/readyz"), interval_s: float = 0.5,
                 timeout_s: float = 5.0) -> None:
        self.port, self.paths, self.interval_s, self.timeout_s = port, paths, interval_s, timeout_s
        self.answers: dict[str, list[Answer]] = {p: [] for p in paths}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, args=(p,), daemon=True) for p in paths]

    def _poll(self, path: str) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.answers[path].append(request(self.port, "GET", path, timeout_s=self.timeout_s))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def __enter__(self) -> HealthPoller:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)

    def latencies(self, path: str) -> list[float]:
        return [a.seconds for a in self.answers[path]]

    def failures(self, path: str, expected: int = 200) -> list[Answer]:
        return [a for a in self.answers[path] if a.status != expected]


# --- slow clients ---------------------------------------------------------------------------------------

def slow_head(content_length: int, path: str = "/predict") -> bytes:
    """The head of an ordinary upload, to /predict unless told (about 200 bytes: more than 60 s of dripping)."""
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nUser-Agent: hostile-dripper/1.0\r\nAccept: */*\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


@dataclass
class Connection:
    """One slow connection: when it opened, when and how it ended, what it had sent."""

    kind: str
    source: str
    opened: float
    path: str = "/predict"
    ended: float = 0.0
    how: str = ""  # "closed" (EOF/reset, no answer), "answered", "open at the end", "connect failed"
    status: int | None = None
    answer: bytes = b""
    bytes_sent: int = 0
    last_sent: float = 0.0

    @property
    def lifetime(self) -> float:
        return self.ended - self.opened

    @property
    def silent_for(self) -> float:
        """From the last byte it sent to its end."""
        return self.ended - (self.last_sent or self.opened)


class Drippers:
    """`counts` slow connections per kind ("headers", "body", "stalled") against port, reconnecting until stopped.

    headers: the request head, one byte every interval_s (it never completes within a minute);
    body:    a complete head (Content-Length: body_length) and `body_first` bytes of the body, then the rest
             one byte every interval_s;
    stalled: a complete head and half the body at once, then nothing.
    Each kind's slots connect from its address in `sources` (ATTACKERS by default), or from several: slot i
    of a kind uses address i modulo their number, and path i modulo the number of `paths` (/predict only by
    default).
    """

    def __init__(self, port: int, counts: dict[str, int], *, interval_s: float = 3.0, body_length: int = 60_000,
                 body_first: int = 0, sources: dict[str, str | Sequence[str]] | None = None,
                 paths: Sequence[str] = ("/predict",)) -> None:
        self.port, self.counts, self.interval_s, self.body_length = port, counts, interval_s, body_length
        self.body_first, self.paths = body_first, list(paths)
        self.sources = {kind: [found] if isinstance(found, str) else list(found)
                        for kind, found in (sources or ATTACKERS).items()}
        self.connections: list[Connection] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stopping: asyncio.Event | None = None
        self._main: object = None

    def __enter__(self) -> Drippers:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._main is not None:
            self._main.result(timeout=30)  # type: ignore[attr-defined]
            self._main = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def open_now(self, kind: str) -> int:
        return sum(1 for c in self.connections if c.kind == kind and c.how == "open at the end")

    def of(self, kind: str) -> list[Connection]:
        return [c for c in self.connections if c.kind == kind]

    async def _run(self) -> None:
        self._stopping = asyncio.Event()
        slots = [self._slot(kind, self.sources[kind][i % len(self.sources[kind])], self.paths[i % len(self.paths)])
                 for kind, n in self.counts.items() for i in range(n)]
        await asyncio.gather(*slots)

    async def _slot(self, kind: str, source: str, path: str) -> None:
        assert self._stopping is not None
        while not self._stopping.is_set():
            record = await self._one(kind, source, path)
            self.connections.append(record)
            if record.how != "open at the end":  # the attacker's pace: reconnect after one interval
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.interval_s)

    async def _one(self, kind: str, source: str, path: str) -> Connection:
        assert self._stopping is not None
        record = Connection(kind, source, opened=time.monotonic(), path=path)
        try:
            reader, writer = await asyncio.open_connection(HOST, self.port, local_addr=(source, 0))
        except OSError as e:
            record.how, record.ended, record.answer = "connect failed", time.monotonic(), repr(e).encode()
            return record
        head = slow_head(self.body_length, path)
        first = {"headers": head[:1], "body": head + b"x" * self.body_first,
                 "stalled": head + b"x" * (self.body_length // 2)}[kind]
        position = len(first)
        stop = asyncio.ensure_future(self._stopping.wait())
        answer = asyncio.ensure_future(reader.read(65536))
        try:
            try:
                writer.write(first)
                await writer.drain()
                record.bytes_sent, record.last_sent = len(first), time.monotonic()
                while True:
                    await asyncio.wait([answer, stop], timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED)
                    if answer.done() or stop.done():
                        break
                    if kind == "headers" and position < len(head):
                        writer.write(head[position:position + 1])
                        position += 1
                    elif kind == "body":
                        writer.write(b"x")
                    else:
                        continue
                    await writer.drain()
                    record.bytes_sent += 1
                    record.last_sent = time.monotonic()
            except OSError:  # a write failed: the server has closed (or reset) the connection
                await asyncio.wait([answer], timeout=1)
            record.ended = time.monotonic()
            if answer.done():
                error = answer.exception()
                data = b"" if error is not None else answer.result()
                record.how, record.answer = ("answered", data) if data else ("closed", b"")
                match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
                record.status = int(match.group(1)) if match else None
            elif stop.done():
                record.how = "open at the end"
            else:
                record.how = "closed"
        finally:
            stop.cancel()
            answer.cancel()
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()
        return record


def tail_lines(path: Path, since: int) -> list[str]:
    """The lines of a growing file past byte offset `since`."""
    with path.open("rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace").splitlines()
