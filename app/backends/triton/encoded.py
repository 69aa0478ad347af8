"""SHIM_TRANSPORT=encoded: the uploads' bytes as they came, several requests' as one BYTES [N, 1] request,
to the model's `<name>_encoded` ensemble, which decodes them in Triton (docs/transports.md).

What app/sniff.py keeps here is decoded by the legacy rules and goes as fp32 tensors. A row the ensemble's decoder
refused (`readable`) comes back to its request's thread (SendAgain), which decodes it: it holds up no other row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from app import metrics, sniff
from app.backends.base import SendAgain
from app.backends.triton.checks import (
    NAME,
    READABLE,
    ModelSpec,
    check_encoded_model,
    check_parameters,
    check_pin,
    decode_step_of,
)
from app.backends.triton.client import Clients
from app.backends.triton.fp32 import Fp32Transport
from app.backends.triton.transport import Row, Target, Transport, log_answer
from app.errors import ModelMismatch, ShimError
from app.images import Upload


@dataclass(frozen=True)
class Forwarded:
    """An upload that goes to Triton as it came."""

    upload: Upload


class EncodedTransport(Transport):
    name = "encoded"

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self._tensors = Fp32Transport(target)  # where the uploads decoded in the shim go

    @property
    def model(self) -> str:
        return self.target.encoded_model

    def refused(self) -> str | None:
        return self.target.encoded_refusal

    def describe(self) -> str:
        return (f"JPEG uploads as they came to {self.model}, which decodes them; other images as FP32 tensors "
                f"to {self.target.model}")

    def prepare(self, upload: Upload) -> Forwarded | Upload:
        reason = sniff.cpu_reason(upload.data, upload.spec)
        if reason is None:
            return Forwarded(upload)
        metrics.ENCODED_CPU_PATH.labels(reason).inc()
        upload.tensor()
        return upload

    def infer(self, clients: Clients, items: Sequence[Forwarded | Upload], request_id: str) -> list[Row | ShimError]:
        rows: list[Row | ShimError | None] = [None] * len(items)
        decoded = [(i, item) for i, item in enumerate(items) if isinstance(item, Upload)]
        forwarded = [(i, item.upload) for i, item in enumerate(items) if isinstance(item, Forwarded)]
        if forwarded:
            logits, readable = self._send(clients, [upload.data for _, upload in forwarded], request_id)
            for (i, upload), row, ok in zip(forwarded, logits, readable, strict=True):
                if ok:
                    rows[i] = row
                    continue
                metrics.ENCODED_CPU_PATH.labels("decoder_refused").inc()
                rows[i] = SendAgain(functools.partial(self._decoded_here, upload))
        if decoded:
            batch = np.stack([upload.tensor() for _, upload in decoded])
            for (i, _), row in zip(decoded, self._tensors.send(clients, batch, request_id), strict=True):
                rows[i] = row
        assert all(row is not None for row in rows)
        return [row for row in rows if row is not None]

    @staticmethod
    def _decoded_here(upload: Upload) -> Upload:
        """By the legacy rules, in the request's thread: a 400 for what Pillow cannot read either."""
        upload.tensor()
        return upload

    def _send(self, clients: Clients, uploads: list[bytes], request_id: str) -> tuple[Any, Any]:
        spec = self.spec or self.check(clients)
        data = np.empty((len(uploads), 1), dtype=np.object_)
        data[:, 0] = uploads
        tensor = httpclient.InferInput(spec.input_name, [len(uploads), 1], "BYTES")
        tensor.set_data_from_numpy(data, binary_data=True)
        wanted = [httpclient.InferRequestedOutput(spec.output_name, binary_data=True),
                  httpclient.InferRequestedOutput(READABLE, binary_data=True)]
        # SHIM_MODEL_VERSION is the classifier's: the ensemble's step for it holds the pin (checked at readiness).
        result = clients.infer(self.model, [tensor], outputs=wanted, request_id=request_id, where=self.where())
        log_answer(result, len(uploads))
        logits = self.checked(result.as_numpy(spec.output_name), len(uploads), self.where())
        readable = result.as_numpy(READABLE)
        if readable is None or readable.shape != (len(uploads), 1):
            raise ModelMismatch(f"{self.where()} answered no '{READABLE}' [{len(uploads)}, 1]", backend=NAME)
        return logits, readable[:, 0].astype(bool)

    def check(self, clients: Clients) -> ModelSpec:
        """The ensemble, its decode step's parameters against the description, then the model the tensors go to."""
        meta = clients.call(lambda c: c.get_model_metadata(self.model), where=self.where())
        config = clients.call(lambda c: c.get_model_config(self.model), where=self.where())
        check_pin(config, ensemble=self.model, classifier=self.target.model, pin=self.target.version,
                  where=self.where())
        spec = check_encoded_model(meta, config, classes=self.target.classes, where=self.where())
        step = decode_step_of(config, model=self.target.model, where=self.where())
        if self.target.decode_parameters is not None:
            step_config = clients.call(lambda c: c.get_model_config(step), where=self.where(step))
            check_parameters(step_config, self.target.decode_parameters, every=True,
                             where=f"Triton model '{step}' (the decode step of {self.model}) at {self.target.url}")
        tensors = self._tensors.check(clients)
        self.spec = ModelSpec(spec.input_name, spec.output_name, min(spec.max_batch_size, tensors.max_batch_size),
                              spec.versions)
        return self.spec
