"""The seam between the shim and whatever computes logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from app.preprocess import Prepared


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str  # what a person reading /readyz needs to know, in one line
    age_s: float = 0.0  # how old the answer is: 0 when it was checked for this call (app/readiness.py)


FP32, UINT8 = "fp32", "uint8"
ENCODED = "encoded"  # the upload's own bytes, one image per call (the encoded transport)


class Backend(Protocol):
    """Turns a batch of preprocessed images into logits [N, classes] FP32.

    Each image comes as its cropped pixels and, when the request thread made it, its normalised FP32
    tensor (app.preprocess.Prepared): a backend takes what it sends, `fp32()` or `uint8()`. `input_kind`
    ("fp32", "uint8" or "encoded") tells request threads which to prepare; a backend whose kind is "encoded"
    is also handed images that carry only their upload's bytes (`encoded`), one per call, by the request
    thread itself (app/batching.py), and takes the others as FP32 tensors. infer() raises
    app.errors.BackendError subclasses only, and DecodeRefused for an upload its decoder refuses. It may be
    called from several threads of one process at once; an implementation
    keeps whatever is not thread-safe per thread.
    """

    name: str

    @property
    def max_batch_size(self) -> int: ...

    @property
    def input_kind(self) -> str: ...

    def start(self) -> None:
        """Begin whatever loading the backend needs, in the background; idempotent, never blocks."""

    def infer(self, images: Sequence[Prepared], request_ids: Sequence[str]) -> npt.NDArray[np.float32]: ...

    def ready(self) -> Readiness: ...

    def close(self) -> None: ...


@runtime_checkable
class MayLack(Protocol):
    """A backend that may be unable to run in this image at all (the legacy one, without torch)."""

    def missing(self) -> str | None:
        """What it lacks here (named for a person), or None."""
