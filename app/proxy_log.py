"""nginx's answers as the shim's metrics: nginx's access log, received as UDP syslog datagrams and counted.

nginx answers many requests itself (its 503s, 413s, 400s, 408s); `python -m app.proxy_log HOST:PORT`, run by
gunicorn's master (app/gunicorn_conf.py), counts them in shim_proxy_responses_total, in the workers' multiprocess
folder (docs/proxy.md). UDP, because a unix datagram socket queues only 10 datagrams in a container and nginx drops
the rest; a process, not a master thread, because a fork would inherit prometheus_client's lock held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

log = logging.getLogger("shim.proxy_log")

RECEIVE_BYTES = 4096  # one access-log line of log_format shim_metrics is under 200 bytes
RECEIVE_BUFFER = 4 << 20  # asked for; the kernel caps it at net.core.rmem_max
RESTART_S = 1.0
# Datagrams gather in the socket's buffer between reads: one wake-up per read instead of one per request costs
# the process a third of the CPU per datagram (bench/RESULTS.md). The pause is shorter at higher rates, so that
# about KEEP_UNDER wait at a time: a default net.core.rmem_max (a 425 KB buffer) holds about 500 of them. After
# an idle socket the rate is unknown: the pause starts at FIRST_S and at most doubles per read, so that a flood
# that follows quiet is measured before it can fill the buffer.
GATHER_S = 0.02
KEEP_UNDER = 128
FIRST_S = 0.001


def parse(datagram: bytes) -> tuple[str, str, str] | None:
    """(path, status, reason) from one syslog datagram of nginx (`<PRI>TIMESTAMP TAG: {json}`); None if not one.
    Label values are bounded whatever arrives: what PROXY_PATHS, 100-599 or PROXY_REASONS lack is "other"."""
    from app.metrics import PROXY_PATHS, PROXY_REASONS

    start = datagram.find(b"{")
    if start < 0:
        return None
    try:
        entry = json.loads(datagram[start:])
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    path, status, reason = entry.get("path"), entry.get("status"), entry.get("refusal", "")
    path = path if path in PROXY_PATHS else "other"
    status = str(status) if isinstance(status, int) and 100 <= status <= 599 else "other"
    reason = reason if reason == "" or reason in PROXY_REASONS else "other"
    return path, status, reason


def initialize() -> None:
    """The series the alerts divide by exist from the start, at zero (deploy/prometheus/alerts.yml)."""
    from app.metrics import PROXY_RESPONSES

    for status, reason in [("200", ""), ("503", ""), ("503", "overloaded"), ("503", "client_limit"),
                           ("413", "too_large"), ("408", "client_timeout")]:
        PROXY_RESPONSES.labels("/predict", status, reason)


def bind(address: str) -> socket.socket:
    """A UDP socket bound to host:port (an IPv6 host in brackets or bare), with a large receive buffer."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.bind((host, int(port)))
    return sock


def serve(sock: socket.socket, stop: threading.Event, parent: int | None = None) -> int:
    """Count every datagram until `stop` is set or the parent process (gunicorn's master) is gone; how many.
    Reads what has gathered, then pauses (see `pause`): what arrives meanwhile waits in the socket's buffer."""
    from app.metrics import PROXY_RESPONSES

    counted = 0
    sock.settimeout(0.5)
    last_read, wait = time.monotonic(), FIRST_S
    while not stop.is_set() and (parent is None or os.getppid() == parent):
        began = time.monotonic()
        try:
            datagrams = [sock.recv(RECEIVE_BYTES)]
        except TimeoutError:
            continue
        datagrams += drain(sock)
        now = time.monotonic()
        wait = pause(len(datagrams), now - last_read, wait, waited_s=now - began)  # arrived since the last read
        last_read = now
        tally: dict[tuple[str, str, str], int] = {}
        for datagram in datagrams:
            labels = parse(datagram)
            if labels is None:
                log.warning("not an access-log line of nginx: %r", datagram[:200])
                continue
            tally[labels] = tally.get(labels, 0) + 1
        for labels, n in tally.items():
            PROXY_RESPONSES.labels(*labels).inc(n)
        counted += sum(tally.values())
        stop.wait(wait)
    return counted


def pause(received: int, over_s: float, previous_s: float, waited_s: float = 0.0) -> float:
    """Seconds to let datagrams gather before the next read: up to GATHER_S, at most twice the previous pause,
    and less when `received` in `over_s` says that more than KEEP_UNDER would arrive meanwhile. A read that
    waited over GATHER_S for its first datagram found the socket idle: FIRST_S."""
    if waited_s > GATHER_S:
        return FIRST_S
    rate = received / max(over_s, 1e-6)
    return min(GATHER_S, 2 * previous_s, KEEP_UNDER / rate)


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram already waiting, without blocking; the socket's timeout as it was."""
    datagrams, timeout = [], sock.gettimeout()
    sock.setblocking(False)
    try:
        while True:
            datagrams.append(sock.recv(RECEIVE_BYTES))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(timeout)
    return datagrams


def main(argv: list[str] | None = None) -> int:
    from app.logs import configure_logging
    from app.settings import Settings

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m app.proxy_log HOST:PORT", file=sys.stderr)
        return 2
    configure_logging(Settings.from_env().log_level)
    address = args[0]
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    initialize()
    try:
        sock = bind(address)
    except (OSError, ValueError) as e:
        log.error("cannot receive nginx's access log on UDP %s: %s", address, e)
        return 1
    log.info("counting nginx's answers sent to UDP %s", address)
    try:
        serve(sock, stop, parent=os.getppid())
    finally:
        sock.close()
    return 0


class Supervisor:
    """gunicorn's master keeps `python -m app.proxy_log HOST:PORT` running: started when it is ready, restarted a
    second after it exits. posix_spawn, not Popen: Popen waits on a pipe until its child has exec'd, and a worker
    forked meanwhile keeps the pipe open for its whole life (seen under load: never restarted). The master reaps
    children it does not know, so the exit, not its status, is what counts."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._thread = threading.Thread(target=self._run, name="proxy-log", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def _run(self) -> None:
        command = [sys.executable, "-m", "app.proxy_log", self.address]
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    break
                try:
                    self._pid = os.posix_spawn(sys.executable, command, os.environ, file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)])
                except OSError as e:
                    log.error("cannot start python -m app.proxy_log: %s", e)
                    self._pid = None
            code = _exit_code(self._pid) if self._pid is not None else None
            with self._lock:  # reaped: its number may soon be another process's, which stop() must not kill
                self._pid = None
            if not self._stop.is_set():
                log.warning("python -m app.proxy_log exited (%s); restarting it", code)
                self._stop.wait(RESTART_S)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            pid = self._pid
        if pid is not None and _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            self._thread.join(timeout=5)
            if _running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._thread.join(timeout=5)


def _exit_code(pid: int) -> int | str:
    """Wait for `pid` to exit; its exit code, or 'reaped by the master' when gunicorn's reaper took it first."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "reaped by the master"
    return os.waitstatus_to_exitcode(status)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
