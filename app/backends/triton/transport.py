"""The small interface every way of sending images to Triton implements; SHIM_TRANSPORT picks one at start.

prepare(upload) runs in the request's thread, under the worker's decode bound, and returns what infer() is handed;
infer(items) sends one batch and returns one entry per item (its logits row, or its own ShimError), raising
BackendError for what fails the whole batch; check() is readiness's: the model's metadata and config.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from app.backends.triton.checks import NAME, ModelSpec
from app.backends.triton.client import Clients
from app.errors import BackendError, ShimError
from app.images import Upload

log = logging.getLogger(__name__)
Row = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Target:
    """The model the shim serves, as every transport needs to know it (from the model's description)."""

    url: str
    model: str
    version: str  # SHIM_MODEL_VERSION: the classifier's version pin, "" for the served one
    crop: tuple[int, int]  # the model input's (height, width)
    classes: int
    parameters: Mapping[str, str] = field(default_factory=dict)  # the description's preprocessing, as configs carry it
    uint8_model: str = ""
    encoded_model: str = ""
    decode_parameters: Mapping[str, str] | None = None  # what the encoded ensemble's decode step must serve
    encoded_refusal: str | None = None  # why the encoded transport cannot serve this model, if it cannot


class Transport(ABC):
    name: ClassVar[str]

    def __init__(self, target: Target) -> None:
        self.target = target
        self.spec: ModelSpec | None = None  # from the last check()

    @property
    @abstractmethod
    def model(self) -> str:
        """The Triton model this transport sends to."""

    @property
    def version(self) -> str:
        """The version asked of `model`: the pin for the classifier, never for an ensemble (its own versions)."""
        return ""

    def refused(self) -> str | None:
        """Why this transport cannot serve the model at all (known from its description), or None."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """What it sends where, for /readyz and the start-up log."""

    @abstractmethod
    def prepare(self, upload: Upload) -> Any: ...

    @abstractmethod
    def infer(self, clients: Clients, items: Sequence[Any], request_id: str) -> list[Row | ShimError]: ...

    @abstractmethod
    def check(self, clients: Clients) -> ModelSpec:
        """The model's metadata and config checked (raises ModelMismatch); sets and returns `spec`."""

    def where(self, model: str | None = None, version: str | None = None) -> str:
        model, version = model or self.model, self.version if version is None else version
        return f"Triton model '{model}'{f' version {version}' if version else ''} at {self.target.url}"

    def checked(self, logits: npt.NDArray[Any] | None, n: int, where: str) -> npt.NDArray[np.float32]:
        """Triton's answer for a batch of n: exactly [n, classes]."""
        if logits is None or logits.shape != (n, self.target.classes):
            raise BackendError(f"{where} answered {None if logits is None else list(logits.shape)} for a batch of {n}",
                               backend=NAME)
        return np.asarray(logits, dtype=np.float32)


def log_answer(result: Any, n: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("Triton answered a batch of %d", n, extra={"triton_request_id": result.get_response().get("id", "")})
