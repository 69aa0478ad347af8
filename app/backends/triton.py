"""Triton over HTTP with binary tensors: the only module that imports tritonclient.

tritonclient's HTTP client is not thread-safe and breaks when carried across a fork, so each thread
gets its own client, made on first use in the process that uses it. Readiness checks use clients of
their own with short timeouts, so that /readyz answers within about SHIM_READINESS_TIMEOUT_S even when
Triton hangs. The model's tensor names, dtypes and dims come from Triton's metadata and are checked
against what the shim sends before the first request; every tritonclient error leaves this module as
one of the shim's own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from app.backends.base import Readiness
from app.errors import BackendError, BackendTimeout, BackendUnavailable, ModelMismatch

log = logging.getLogger(__name__)
T = TypeVar("T")
NAME = "triton"
# Triton answers 400 with these words when the model is absent or not (yet) loaded.
UNAVAILABLE_MARKERS = ("unknown model", "not ready", "no available versions", "not found", "unavailable")
SPEC_RECHECK_S = 5.0  # readiness re-reads the model's metadata at most this often (a reload may change it)


@dataclass(frozen=True)
class ModelSpec:
    input_name: str
    output_name: str
    max_batch_size: int
    versions: tuple[str, ...]


def check_model(meta: dict[str, Any], config: dict[str, Any], *, image_shape: Sequence[int], classes: int,
                where: str) -> ModelSpec:
    """The model's metadata against what the shim sends ([N, *image_shape] FP32) and expects back."""
    want_in = f"FP32 [-1, {', '.join(map(str, image_shape))}]"
    if len(meta.get("inputs", [])) != 1 or len(meta.get("outputs", [])) != 1:
        raise ModelMismatch(f"{where} has {len(meta.get('inputs', []))} inputs and {len(meta.get('outputs', []))} "
                            f"outputs; the shim needs one image input ({want_in}) and one logits output", backend=NAME)
    (inp,), (out,) = meta["inputs"], meta["outputs"]
    in_shape, out_shape = list(inp["shape"]), list(out["shape"])
    if inp["datatype"] != "FP32" or len(in_shape) != 4 or in_shape[1:] != list(image_shape):
        raise ModelMismatch(f"{where} input '{inp['name']}' is {inp['datatype']} {in_shape}; the shim sends {want_in}",
                            backend=NAME)
    if out["datatype"] != "FP32" or len(out_shape) != 2 or out_shape[1] != classes:
        raise ModelMismatch(f"{where} output '{out['name']}' is {out['datatype']} {out_shape}; the shim expects "
                            f"FP32 [-1, {classes}] (one score per label in its labels file)", backend=NAME)
    max_batch = int(config.get("max_batch_size", 0)) or (in_shape[0] if in_shape[0] > 0 else 1)
    return ModelSpec(inp["name"], out["name"], max_batch, tuple(meta.get("versions", [])))


class _Clients:
    """One tritonclient per thread of the process that made it, all closed together."""

    def __init__(self, url: str, *, connect_timeout_s: float, network_timeout_s: float) -> None:
        self._url = url
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
            client = httpclient.InferenceServerClient(self._url, **self._timeouts)
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


class TritonBackend:
    name = NAME

    def __init__(self, *, url: str, model: str, version: str, connect_timeout_s: float, network_timeout_s: float,
                 readiness_timeout_s: float, image_shape: Sequence[int], classes: int, max_batch_size: int) -> None:
        self.url, self.model, self.version = url, model, version
        self._image_shape, self._classes, self._max_batch = tuple(image_shape), classes, max_batch_size
        self._where = f"Triton model '{model}'{f' version {version}' if version else ''} at {url}"
        self._clients = _Clients(url, connect_timeout_s=connect_timeout_s, network_timeout_s=network_timeout_s)
        self._probes = _Clients(url, connect_timeout_s=min(connect_timeout_s, readiness_timeout_s),
                                network_timeout_s=readiness_timeout_s)
        self._spec: ModelSpec | None = None
        self._spec_checked = 0.0
        self._mismatch_logged = False

    @property
    def max_batch_size(self) -> int:
        spec = self._spec
        return min(self._max_batch, spec.max_batch_size) if spec else self._max_batch

    def start(self) -> None:
        """Nothing to load: the first call in each thread makes its client; metadata comes on first use."""

    def ready(self) -> Readiness:
        """The model ready on Triton, its metadata checked (again, every few seconds: a reload may change it)."""
        try:
            if not self._call(self._probes, lambda c: c.is_model_ready(self.model, self.version)):
                return Readiness(False, f"{self._where} is not ready")
            spec = self._spec
            if spec is None or time.monotonic() - self._spec_checked > SPEC_RECHECK_S:
                spec = self._fetch_spec(self._probes)
        except BackendError as e:
            return Readiness(False, e.message)
        return Readiness(True, f"{self._where} is ready (versions {', '.join(spec.versions) or '?'}, "
                               f"max batch {spec.max_batch_size})")

    def infer(self, batch: npt.NDArray[np.float32], request_ids: Sequence[str]) -> npt.NDArray[np.float32]:
        spec = self._spec or self._fetch_spec(self._clients)
        tensor = httpclient.InferInput(spec.input_name, list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch, binary_data=True)
        wanted = httpclient.InferRequestedOutput(spec.output_name, binary_data=True)
        # Every request ID of the batch (at most 32 x 128 characters): Triton's logs and answer carry them.
        request_id = ",".join(request_ids)
        result = self._call(self._clients, lambda c: c.infer(self.model, [tensor], model_version=self.version,
                                                             outputs=[wanted], request_id=request_id))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("Triton answered a batch of %d", len(batch),
                      extra={"triton_request_id": result.get_response().get("id", "")})
        logits = result.as_numpy(spec.output_name)
        if logits is None or logits.shape != (batch.shape[0], self._classes):
            raise BackendError(f"{self._where} answered {None if logits is None else list(logits.shape)} "
                               f"for a batch of {batch.shape[0]}", backend=NAME)
        return np.asarray(logits, dtype=np.float32)

    def close(self) -> None:
        self._clients.close()
        self._probes.close()

    def _fetch_spec(self, clients: _Clients) -> ModelSpec:
        meta = self._call(clients, lambda c: c.get_model_metadata(self.model, self.version))
        config = self._call(clients, lambda c: c.get_model_config(self.model, self.version))
        try:
            spec = check_model(meta, config, image_shape=self._image_shape, classes=self._classes,
                               where=self._where)
        except ModelMismatch as e:
            if not self._mismatch_logged:
                log.error("%s", e.message)  # once: readiness repeats it to whoever asks
                self._mismatch_logged = True
            self._spec = None
            raise
        self._spec, self._spec_checked, self._mismatch_logged = spec, time.monotonic(), False
        return spec

    def _call(self, clients: _Clients, call: Callable[[httpclient.InferenceServerClient], T]) -> T:
        """Run one tritonclient call on this thread's client; translate whatever it raises."""
        try:
            return call(clients.get())
        except InferenceServerException as e:
            text = str(e.message() or e)
            if any(marker in text.lower() for marker in UNAVAILABLE_MARKERS):
                self._spec = None  # whatever comes back may be another version: check it again
                raise BackendUnavailable(f"{self._where} is unavailable: {text}", backend=NAME) from e
            if "timeout" in text.lower() or "deadline" in text.lower():
                raise BackendTimeout(f"{self._where} timed out: {text}", backend=NAME) from e
            raise BackendError(f"{self._where} failed the request: {text}", backend=NAME) from e
        except TimeoutError as e:
            clients.drop()
            raise BackendTimeout(f"{self._where} did not answer within {clients.network_timeout_s:g} s",
                                 backend=NAME) from e
        except OSError as e:  # refused, reset, unreachable, DNS
            clients.drop()
            raise BackendUnavailable(f"{self._where} is unreachable: {e}", backend=NAME) from e
