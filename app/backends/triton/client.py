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
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import quote

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from app.backends.triton.wire import ConnectTimeout, Wire
from app.errors import BackendError, BackendTimeout, BackendUnavailable

T = TypeVar("T")
NAME = "triton"
# Triton answers 400 with these words when the model is absent or not (yet) loaded.
# "exceeds maximum queue size": the model's queue policy ([triton] max_queue_size) refused it: Triton is overloaded
UNAVAILABLE_MARKERS = ("unknown model", "not ready", "no available versions", "not found", "unavailable",
                       "exceeds maximum queue size")


class Clients:
    """One tritonclient per thread of the process that made it, and one Wire for its infer calls; all closed
    together."""

    def __init__(self, url: str, *, connect_timeout_s: float, network_timeout_s: float) -> None:
        self.url = url
        self._timeouts = {"connection_timeout": connect_timeout_s, "network_timeout": network_timeout_s}
        host, _, port = url.rpartition(":")
        self._address = (host.strip("[]"), int(port))  # settings checked the URL's form: host:port
        self.network_timeout_s = network_timeout_s
        self._pid = os.getpid()
        self._local = threading.local()
        self._all: list[httpclient.InferenceServerClient] = []
        self._wires: list[Wire] = []
        self._lock = threading.Lock()

    def get(self) -> httpclient.InferenceServerClient:
        self._check_fork()
        client: httpclient.InferenceServerClient | None = getattr(self._local, "client", None)
        if client is None:
            client = httpclient.InferenceServerClient(self.url, **self._timeouts)
            self._local.client = client
            with self._lock:
                self._all.append(client)
        return client

    def wire(self) -> Wire:
        self._check_fork()
        wire: Wire | None = getattr(self._local, "wire", None)
        if wire is None:
            wire = Wire(*self._address, connect_timeout_s=self._timeouts["connection_timeout"],
                        network_timeout_s=self.network_timeout_s)
            self._local.wire = wire
            with self._lock:
                self._wires.append(wire)
        return wire

    def infer(self, model: str, inputs: Sequence[httpclient.InferInput], *, outputs: Sequence[
              httpclient.InferRequestedOutput], version: str = "", request_id: str = "",
              where: str) -> httpclient.InferResult:
        """tritonclient's infer(), its request and answer built and parsed by tritonclient, sent on this
        thread's Wire; errors translated as call()'s."""
        body, json_size = httpclient.InferenceServerClient.generate_request_body(
            list(inputs), outputs=list(outputs), request_id=request_id)
        path = f"/v2/models/{quote(model)}{f'/versions/{version}' if version else ''}/infer"
        headers = {} if json_size is None else {"Inference-Header-Content-Length": str(json_size)}

        def send() -> httpclient.InferResult:
            answer, data = self.wire().post(path, body, headers)
            size = answer.get("inference-header-content-length")
            return httpclient.InferenceServerClient.parse_response_body(
                data, header_length=None if size is None else int(size))
        return self._translated(send, where=where)

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("TritonBackend was created before a fork; create the app in each worker "
                               "(gunicorn without --preload)")

    def drop(self) -> None:
        """After a transport error the connection state is unknown: this thread's next call starts afresh."""
        client = getattr(self._local, "client", None)
        wire = getattr(self._local, "wire", None)
        self._local.client = self._local.wire = None
        with self._lock:
            if client in self._all:
                self._all.remove(client)
            if wire in self._wires:
                self._wires.remove(wire)
        if client is not None:
            client.close()
        if wire is not None:
            wire.close()

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
            wires, self._wires = self._wires, []
        for client in clients:
            client.close()
        for wire in wires:
            wire.close()

    def call(self, call: Callable[[httpclient.InferenceServerClient], T], *, where: str) -> T:
        """One tritonclient call on this thread's client; whatever it raises translated (`where`: the model)."""
        return self._translated(lambda: call(self.get()), where=where)

    def _translated(self, call: Callable[[], T], *, where: str) -> T:
        """`call()`, whatever it raises as one of the shim's errors (its cause kept)."""
        started = time.monotonic()
        try:
            return call()
        except InferenceServerException as e:  # Triton answered, with an error
            text = str(e.message() or e)
            if any(marker in text.lower() for marker in UNAVAILABLE_MARKERS):
                raise BackendUnavailable(f"{where} is unavailable: {text}", backend=NAME) from e
            if "timeout" in text.lower() or "deadline" in text.lower():
                raise BackendTimeout(f"{where} timed out: {text}", backend=NAME) from e
            raise BackendError(f"{where} failed the request: {text}", backend=NAME) from e
        except TimeoutError as e:
            self.drop()
            if isinstance(e, ConnectTimeout) or time.monotonic() - started < self.network_timeout_s * 0.9:
                # the connect timed out, not the call
                raise BackendUnavailable(f"{where} accepts no connection (the connect timed out)", backend=NAME) from e
            raise BackendTimeout(f"{where} did not answer within {self.network_timeout_s:g} s", backend=NAME) from e
        except (OSError, http.client.HTTPException) as e:  # refused, reset, unreachable, DNS; closed mid-answer
            self.drop()
            raise BackendUnavailable(f"{where} is unreachable: {type(e).__name__}: {e}", backend=NAME) from e
