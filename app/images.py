"""One request's image as the backends take it: the upload's bytes, decoded at most once, when first asked.

A backend's prepare() asks for pixels(), tensor() or nothing; whoever asks later (a fallback, a shadow call) gets
the same arrays. Each piece of work is noted in `timings` (stage, wall and CPU seconds) for the stage metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from app.preprocess import ImageSpec, crop, decode, normalize

T = TypeVar("T")


class Upload:
    def __init__(self, data: bytes, spec: ImageSpec, *, pixels: npt.NDArray[np.uint8] | None = None,
                 tensor: npt.NDArray[np.float32] | None = None) -> None:
        self.data = data
        self.spec = spec
        self._pixels = pixels
        self._tensor = tensor
        self.timings: list[tuple[str, float, float]] = []

    def pixels(self) -> npt.NDArray[np.uint8]:
        """The cropped uint8 HWC pixels, by the legacy rules (raises the contract's InvalidImage / TooLarge)."""
        if self._pixels is None:
            image = self._timed("decode", lambda: decode(self.data, self.spec))
            self._pixels = self._timed("preprocess", lambda: crop(image, self.spec))
        return self._pixels

    def tensor(self) -> npt.NDArray[np.float32]:
        """The normalised FP32 CHW tensor the legacy app's transform makes."""
        if self._tensor is None:
            pixels = self.pixels()
            self._tensor = self._timed("preprocess", lambda: normalize(pixels, self.spec))
        return self._tensor

    def _timed(self, stage: str, work: Callable[[], T]) -> T:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return work()
        finally:
            self.timings.append((stage, time.perf_counter() - started, time.thread_time() - cpu))
