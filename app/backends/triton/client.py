"""tritonclient's HTTP clients, one per thread of the worker that uses them, and their errors translated.

tritonclient's HTTP client is not thread-safe and breaks when carried across a fork, so each thread gets
its own, made on first use in the process that uses it. Every tritonclient error leaves call() as one of the
shim's own (app/errors.py), with the original as its cause.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from app.errors import BackendError, BackendTimeout, BackendUnavailable

T = TypeVar("T")
NAME = "triton"
# Triton answers 400 with these words when the model is absent or not (yet) loaded.
# "exceeds maximum queue size": the model's queue policy ([triton] max_queue_size) refused it: Triton is overloaded
UNAVAILABLE_MARKERS = ("unknown model", "not ready", "no available versions", "not found", "unavailable",
                       "exceeds maximum queue size")


class Clients:
    """One tritonclient per thread of the process that made it, all closed together."""

    def __init__(self, url: str, *, connect_timeout_s: float, network_timeout_s: float) -> None:
        self.url = url
        self._timeouts = {"connection_timeout": connect_timeout_s, "network_timeout": network_timeout_s}
        self.network_timeout_s = network_timeout_s
        self._pid = os.getpid()
        self._local = threading.local()
        self._all: list[httpclient.InferenceServerClient] = []
        self._lock = threading.Lock()

    def get(self) -> httpclient.InferenceServerClient:
        if os.getpid() != self._pid:
            raise RuntimeError("TritonBackend was created before a fork; create the app in each worker "
                               "(gunicorn without --preload)")
        client: httpclient.InferenceServerClient | None = getattr(self._local, "client", None)
        if client is None:
            client = httpclient.InferenceServerClient(self.url, **self._timeouts)
            self._local.client = client
            with self._lock:
                self._all.append(client)
        return client

    def drop(self) -> None:
        """After a transport error the connection state is unknown: this thread's next call starts afresh."""
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            with self._lock:
                if client in self._all:
                    self._all.remove(client)
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()

    def call(self, call: Callable[[httpclient.InferenceServerClient], T], *, where: str) -> T:
        """One tritonclient call on this thread's client; whatever it raises translated (`where`: the model)."""
        started = time.monotonic()
        try:
            return call(self.get())
        except InferenceServerException as e:  # Triton answered, with an error
            text = str(e.message() or e)
            if any(marker in text.lower() for marker in UNAVAILABLE_MARKERS):
                raise BackendUnavailable(f"{where} is unavailable: {text}", backend=NAME) from e
            if "timeout" in text.lower() or "deadline" in text.lower():
                raise BackendTimeout(f"{where} timed out: {text}", backend=NAME) from e
            raise BackendError(f"{where} failed the request: {text}", backend=NAME) from e
        except TimeoutError as e:
            self.drop()
            if time.monotonic() - started < self.network_timeout_s * 0.9:  # the connect timed out, not the call
                raise BackendUnavailable(f"{where} accepts no connection (the connect timed out)", backend=NAME) from e
            raise BackendTimeout(f"{where} did not answer within {self.network_timeout_s:g} s", backend=NAME) from e
        except (OSError, http.client.HTTPException) as e:  # refused, reset, unreachable, DNS; closed mid-answer
            self.drop()
            raise BackendUnavailable(f"{where} is unreachable: {type(e).__name__}: {e}", backend=NAME) from e
