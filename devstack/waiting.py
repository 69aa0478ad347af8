"""Wait for a condition with a deadline: one way, for the embedded server, the tools, the benchmark and the tests."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


class WaitTimeout(TimeoutError):
    """The message says what was awaited."""


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, *, interval_s: float = 0.2,
               give_up: Callable[[], str | None] | None = None) -> None:
    """Poll `predicate`; WaitTimeout after `timeout_s`, or at once when `give_up` gives a reason (a death)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        reason = give_up() if give_up is not None else None
        if reason:
            raise WaitTimeout(f"stopped waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status a GET of `url` answers, or None when nothing answers in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):  # refused, reset, timed out: not up (yet)
        return None


def wait_for_http(url: str, timeout_s: float, *, status: int = 200, what: str | None = None,
                  give_up: Callable[[], str | None] | None = None) -> None:
    wait_until(lambda: http_status(url) == status, timeout_s, what or f"{url} to answer {status}",
               interval_s=0.25, give_up=give_up)


def exited(process: subprocess.Popen[bytes], name: str) -> Callable[[], str | None]:
    """A give_up for a subprocess: its exit ends the wait."""
    return lambda: None if process.poll() is None else f"{name} exited ({process.returncode})"
