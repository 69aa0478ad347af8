"""The seam between the shim and whatever computes logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str  # what a person reading /readyz needs to know, in one line


class Backend(Protocol):
    """Turns a batch of preprocessed images [N, 3, H, W] FP32 into logits [N, classes] FP32.

    infer() raises app.errors.BackendError subclasses only. It may be called from several threads
    of one process at once; an implementation keeps whatever is not thread-safe per thread.
    """

    name: str

    @property
    def max_batch_size(self) -> int: ...

    def start(self) -> None:
        """Begin whatever loading the backend needs, in the background; idempotent, never blocks."""

    def infer(self, batch: npt.NDArray[np.float32], request_ids: Sequence[str]) -> npt.NDArray[np.float32]: ...

    def ready(self) -> Readiness: ...

    def close(self) -> None: ...
