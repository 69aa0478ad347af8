"""A closed-loop HTTP/1.1 load generator cheap enough not to be what a benchmark measures.

A spawned process, one asyncio loop, one keep-alive connection per client; every request is prebuilt bytes and
every answer is checked (status 200 and a marker), so an error never counts as a fast success. Standard library
only: the child starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Slots of the progress array the child updates and the parent reads (lock-free: one writer).
DONE, ERRORS, PHASE = 0, 1, 2
IDLE, WARMUP, MEASURE, DRAIN = 0.0, 1.0, 2.0, 3.0
PHASES = {IDLE: "idle", WARMUP: "warm-up", MEASURE: "measure", DRAIN: "drain"}
BOUNDARY = "benchboundary7e3f9a2c41d8"  # of every multipart upload (bench/wrk.py's too)


@dataclass(frozen=True)
class Job:
    host: str
    port: int
    requests: tuple[bytes, ...]  # complete HTTP/1.1 requests; client i starts at requests[i % len]
    expect: bytes  # what every good answer's body contains (b"" = any 200)
    concurrency: int
    warmup_s: float
    duration_s: float
    timeout_s: float = 60.0
    first_client: int = 0  # index of this process's first client, when several processes share a run
    start_at: float | None = None  # time.monotonic() (one clock for every process) at which the warm-up starts
    # (group name, root PIDs) whose CPU this process reads as the window opens and closes (only one process's)
    watch: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Local addresses client i connects from (i % len): several of 127.0.0.0/8 look like several hosts
    sources: tuple[str, ...] = ()


@dataclass
class Outcome:
    """Every completed request: start (seconds from the window's start, negative in warm-up), latency, error,
    and which client sent it."""

    starts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "" for a good answer
    ends: list[float] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)  # the sending client's index (unique across processes)
    window_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the measured window
    unfinished: int = 0  # requests still open when the run gave up waiting for them
    cpu_window: dict[str, dict[str, float]] | None = None  # Job.watch's groups: CPU over the window (bench/cpu.py)

    def record(self, started: float, ended: float, window_start: float, error: str = "", client: int = 0) -> None:
        self.starts.append(started - window_start)
        self.ends.append(ended - window_start)
        self.latencies.append(ended - started)
        self.errors.append(error)
        self.clients.append(client)

    def add(self, other: Outcome) -> None:
        """Another process's share of the same run."""
        self.starts += other.starts
        self.ends += other.ends
        self.latencies += other.latencies
        self.errors += other.errors
        self.clients += other.clients
        self.cpu_s += other.cpu_s
        self.unfinished += other.unfinished
        self.cpu_window = self.cpu_window or other.cpu_window


def multipart_request(host: str, port: int, path: str, field_name: str, filename: str, content_type: str,
                      data: bytes) -> bytes:
    """A POST with one file in multipart/form-data, as `requests.post(url, files={...})` sends it."""
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field_name}\"; filename=\"{filename}\"\r\n"
            f"Content-Type: {content_type}\r\n\r\n").encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()
    return post_request(host, port, path, body, f"multipart/form-data; boundary={BOUNDARY}")


def post_request(host: str, port: int, path: str, body: bytes, content_type: str,
                 extra_headers: Sequence[tuple[str, str]] = ()) -> bytes:
    headers = [("Host", f"{host}:{port}"), ("User-Agent", "flask-triton-shim-bench"), ("Accept", "*/*"),
               ("Connection", "keep-alive"), ("Content-Type", content_type), ("Content-Length", str(len(body))),
               *extra_headers]
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 response: (status, body, whether the connection stays open)."""
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP status line: {line[:80]!r}")
    status = int(parts[1])
    length, chunked, keep = None, False, parts[0] != b"HTTP/1.0"
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = b"close" not in value
    if chunked:
        chunks = []
        while size := int((await reader.readline()).split(b";")[0], 16):
            chunks.append(await reader.readexactly(size))
            await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return status, b"".join(chunks), keep
    if length is not None:
        return status, await reader.readexactly(length), keep
    return status, await reader.read(), False


async def run_job(job: Job, progress: Any | None = None) -> Outcome:
    out = Outcome()
    now = time.monotonic()
    loop_start = max(now, job.start_at) if job.start_at is not None else now
    window_start = loop_start + job.warmup_s
    window_end = window_start + job.duration_s
    marks: dict[str, float] = {}

    def set_progress(slot: int, value: float) -> None:
        if progress is not None:
            progress[slot] = value

    set_progress(PHASE, WARMUP)

    async def client(index: int) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        k = index
        while time.monotonic() < window_end:
            request = job.requests[k % len(job.requests)]
            k += 1
            started = time.monotonic()
            error = ""
            keep = True
            try:
                async with asyncio.timeout(job.timeout_s):
                    if writer is None:
                        source = job.sources[index % len(job.sources)] if job.sources else None
                        reader, writer = await asyncio.open_connection(
                            job.host, job.port, local_addr=(source, 0) if source else None)
                        sock = writer.get_extra_info("socket")
                        if sock is not None:
                            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    assert reader is not None
                    writer.write(request)
                    await writer.drain()
                    status, body, keep = await read_response(reader)
                if status != 200:
                    error = f"HTTP {status}"
                elif job.expect and job.expect not in body:
                    error = "unexpected body"
            except TimeoutError:
                error, keep = "timeout", False
            except (OSError, EOFError, ValueError, asyncio.IncompleteReadError) as e:
                error, keep = type(e).__name__, False
            out.record(started, time.monotonic(), window_start, error, client=index)
            if progress is not None:
                progress[DONE] += 1
                if error:
                    progress[ERRORS] += 1
            if not keep and writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                reader = writer = None
            if error and error != "timeout":
                await asyncio.sleep(0.01)  # a refused connection must not spin the loop
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    watch = dict(job.watch)
    snapshots: list[Any] = []
    if watch:
        from bench import cpu  # the standard library only, like this module

    async def clock() -> None:
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        if watch:
            snapshots.append(cpu.snapshot(watch))
        marks["cpu0"] = time.process_time()
        set_progress(PHASE, MEASURE)
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        marks["cpu1"] = time.process_time()
        if watch:
            snapshots.append(cpu.snapshot(watch))
        set_progress(PHASE, DRAIN)

    await asyncio.sleep(max(0.0, loop_start - time.monotonic()))
    tasks = [asyncio.create_task(client(job.first_client + i)) for i in range(job.concurrency)]
    await clock()
    _, pending = await asyncio.wait(tasks, timeout=job.timeout_s + 5)
    for task in pending:
        task.cancel()
    out.unfinished = len(pending)
    out.window_s = job.duration_s
    out.cpu_s = marks["cpu1"] - marks["cpu0"]
    if watch:
        out.cpu_window = cpu.window_seconds(*snapshots)
    set_progress(PHASE, IDLE)
    return out


def _serve(conn: multiprocessing.connection.Connection, progress: Any) -> None:
    """The child: run each Job it is sent, answer with its Outcome (or the error's text); None ends it."""
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(asyncio.run(run_job(job, progress)))
        except Exception:
            conn.send(traceback.format_exc())


class LoadGenerator:
    """The parent's handle on the load-generating child processes (one is plenty for a few hundred QPS)."""

    def __init__(self, processes: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.processes = processes
        self._children = []
        for index in range(processes):
            progress = ctx.Array("d", 3, lock=False)
            conn, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, progress), name=f"bench-loadgen-{index}", daemon=True)
            process.start()
            child.close()
            self._children.append((process, conn, progress))

    def split(self, job: Job) -> list[Job]:
        """The job's clients spread over the processes, all starting on one clock."""
        start_at = time.monotonic() + (0.5 if self.processes > 1 else 0.0)
        counts = [job.concurrency // self.processes + (i < job.concurrency % self.processes)
                  for i in range(self.processes)]
        firsts = [sum(counts[:i]) for i in range(self.processes)]
        return [dataclasses.replace(job, concurrency=n, first_client=first, start_at=start_at,
                                    watch=job.watch if first == 0 else ())
                for n, first in zip(counts, firsts, strict=True)]

    def run(self, job: Job, on_tick: Callable[[float, int, int], None] | None = None,
            tick_s: float = 0.25) -> Outcome:
        """Run `job` in the children; call on_tick(seconds since start, answers, errors) while it runs."""
        parts = [(child, part) for child, part in zip(self._children, self.split(job), strict=True)
                 if part.concurrency > 0]
        for (_, conn, progress), part in parts:
            progress[DONE] = progress[ERRORS] = 0
            conn.send(part)
        started = time.monotonic()
        answers: dict[int, object] = {}
        while len(answers) < len(parts):
            for i, ((process, conn, _), _) in enumerate(parts):
                if i not in answers and conn.poll():
                    answers[i] = conn.recv()
                elif i not in answers and not process.is_alive():
                    raise RuntimeError(f"the load generator died (exit code {process.exitcode})")
            if on_tick is not None:
                on_tick(time.monotonic() - started, *self._counts())
            if len(answers) < len(parts):
                multiprocessing.connection.wait([conn for i, ((_, conn, _), _) in enumerate(parts)
                                                 if i not in answers], timeout=tick_s)
        merged = Outcome(window_s=job.duration_s)
        for answer in answers.values():
            if isinstance(answer, str):
                raise RuntimeError(f"the load generator failed:\n{answer}")
            assert isinstance(answer, Outcome)
            merged.add(answer)
        return merged

    @property
    def pids(self) -> tuple[int, ...]:
        """The load-generating processes (for their CPU time over a window)."""
        return tuple(process.pid for process, _, _ in self._children if process.pid is not None)

    def _counts(self) -> tuple[int, int]:
        return (int(sum(p[DONE] for _, _, p in self._children)), int(sum(p[ERRORS] for _, _, p in self._children)))

    @property
    def phase(self) -> str:
        """The first process's phase: they all follow one clock."""
        return PHASES.get(self._children[0][2][PHASE], "?")

    def close(self) -> None:
        for process, conn, _ in self._children:
            if process.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for process, conn, _ in self._children:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A trivial server, to measure the generator's own ceiling: it reads each request whole and answers "ok".

STUB_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


async def _stub_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            length = 0
            line = await reader.readline()
            if not line:
                break
            while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            writer.write(STUB_ANSWER)
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def _stub_main(conn: multiprocessing.connection.Connection) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_stub_connection, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class StubServer:
    """An asyncio HTTP server in its own process that answers every request with 200 "ok"."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_stub_main, args=(child,), name="bench-stub", daemon=True)
        self._process.start()
        if not parent.poll(30):
            self.stop()
            raise RuntimeError("the stub server did not start")
        self.port = int(parent.recv())
        parent.close()

    def stop(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)

    def __enter__(self) -> StubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
