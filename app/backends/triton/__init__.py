"""Triton over HTTP with binary tensors: the only package that imports tritonclient.

SHIM_TRANSPORT picks once at start how images travel, one class each (fp32.py, uint8.py, encoded.py; transport.py
is their interface; docs/transports.md). Readiness uses clients of its own with short timeouts, so that /readyz
answers within about SHIM_READINESS_TIMEOUT_S even when Triton hangs; client.py translates tritonclient's errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from app import metrics
from app.backends.base import Readiness
from app.backends.triton.checks import ModelSpec
from app.backends.triton.client import NAME, Clients
from app.backends.triton.encoded import EncodedTransport
from app.backends.triton.fp32 import Fp32Transport
from app.backends.triton.transport import Row, Target, Transport
from app.backends.triton.uint8 import Uint8Transport
from app.errors import BackendError, BackendUnavailable, ModelMismatch, ShimError
from app.images import Upload

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = ["TRANSPORTS", "Target", "TritonBackend", "transport_for"]
log = logging.getLogger(__name__)
SPEC_RECHECK_S = 5.0  # readiness re-reads the model's metadata at most this often (a reload may change it)
TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (Fp32Transport, Uint8Transport, EncodedTransport)}


def transport_for(settings: Settings) -> type[Transport]:
    """The class SHIM_TRANSPORT names (app.settings validated the name at start)."""
    return TRANSPORTS[settings.transport]


class TritonBackend:
    name = NAME

    def __init__(self, transport: Transport, *, connect_timeout_s: float, network_timeout_s: float,
                 readiness_timeout_s: float, max_batch_size: int) -> None:
        self._transport = transport
        self.url = transport.target.url
        self._max_batch = max_batch_size
        self._clients = Clients(self.url, connect_timeout_s=connect_timeout_s, network_timeout_s=network_timeout_s)
        self._probes = Clients(self.url, connect_timeout_s=min(connect_timeout_s, readiness_timeout_s),
                               network_timeout_s=readiness_timeout_s)
        self._spec_checked = 0.0
        self._mismatch_logged = False
        metrics.publish_transport(transport.name)

    @property
    def transport(self) -> str:
        return self._transport.name

    @property
    def max_batch_size(self) -> int:
        spec = self._transport.spec
        return min(self._max_batch, spec.max_batch_size) if spec else self._max_batch

    def start(self) -> None:
        """Nothing to load: the first call in each thread makes its client; metadata comes on first use."""

    def prepare(self, upload: Upload) -> Any:
        return self._transport.prepare(upload)

    def ready(self) -> Readiness:
        """The model ready on Triton, its metadata checked (again, every few seconds: a reload may change it)."""
        t = self._transport
        try:
            if t.refused():
                self._check(self._probes)  # raises, saying why
            if not self._probes.call(lambda c: c.is_model_ready(t.model, t.version), where=t.where()):
                return Readiness(False, f"{t.where()} is not ready")
            spec = t.spec
            if spec is None or time.monotonic() - self._spec_checked > SPEC_RECHECK_S:
                spec = self._check(self._probes)
        except BackendError as e:
            return Readiness(False, e.message)
        return Readiness(True, f"{t.where()} is ready (versions {', '.join(spec.versions) or '?'}, max batch "
                               f"{spec.max_batch_size}); transport {t.name}: {t.describe()}")

    def infer(self, items: Sequence[Any], request_ids: Sequence[str]) -> list[Row | ShimError]:
        if self._transport.spec is None:
            self._check(self._clients)
        try:  # every request ID of the batch (at most 32 x 128 characters): Triton's logs and answer carry them
            return self._transport.infer(self._clients, items, ",".join(request_ids))
        except BackendUnavailable:
            self._transport.spec = None  # whatever comes back may be another version: check it again
            raise

    def close(self) -> None:
        self._clients.close()
        self._probes.close()

    def _check(self, clients: Clients) -> ModelSpec:
        try:
            refused = self._transport.refused()
            if refused:
                raise ModelMismatch(refused, backend=NAME)
            spec = self._transport.check(clients)
        except BackendError as e:
            self._transport.spec = None
            if isinstance(e, ModelMismatch) and not self._mismatch_logged:
                log.error("%s", e.message)  # once: readiness repeats it to whoever asks
                self._mismatch_logged = True
            raise
        self._spec_checked, self._mismatch_logged = time.monotonic(), False
        return spec
