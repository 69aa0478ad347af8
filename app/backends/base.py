"""The seam between the shim and whatever computes logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from app.errors import ShimError

if TYPE_CHECKING:
    from app.images import Upload

Row = npt.NDArray[np.float32]  # one image's logits [classes]
# What infer() returns: one entry per item, in order, its logits or its own error; a [N, classes] array is N rows.
Rows = npt.NDArray[np.float32] | Sequence[Row | ShimError]


class SendAgain(ShimError):
    """A row the backend could not answer as sent: `make()`, run in the request's own thread under the worker's
    decode bound (app/batching.py), returns the item to send instead, or raises the upload's own error. The
    batch's sender never does that CPU work: it would hold up every other row of its next batch."""

    def __init__(self, make: Callable[[], Any]) -> None:
        super().__init__("the backend asks for this upload again, prepared otherwise")
        self.make = make


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str  # what a person reading /readyz needs to know, in one line
    age_s: float = 0.0  # how old the answer is: 0 when it was checked for this call (app/readiness.py)


class Backend(Protocol):
    """Turns batches of uploads into logits [classes] FP32, one row per upload, as a Triton transport does
    (app/backends/triton/transport.py). Called from several threads at once: what is not thread-safe is kept
    per thread."""

    name: str

    @property
    def max_batch_size(self) -> int: ...

    def start(self) -> None:
        """Begin whatever loading the backend needs, in the background; idempotent, never blocks."""

    def prepare(self, upload: Upload) -> Any: ...

    def infer(self, items: Sequence[Any], request_ids: Sequence[str]) -> Rows: ...

    def ready(self) -> Readiness: ...

    def close(self) -> None: ...


@runtime_checkable
class MayLack(Protocol):
    """A backend that may be unable to run in this image at all (the legacy one, without torch)."""

    def missing(self) -> str | None:
        """What it lacks here (named for a person), or None."""
