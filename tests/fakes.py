"""Fakes at the Backend seam, for testing what sits above it (batcher, router). Never Triton itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from app.backends.base import Readiness
from app.errors import BackendError, BackendUnavailable

POISON = -7.0  # an image whose first value is POISON makes the fake fail the batch it is in


class EchoBackend:
    """Logits [N, 1000] whose first value is the first value of each image: answers are traceable."""

    def __init__(self, name: str = "fake", max_batch_size: int = 32, delay_s: float = 0.0) -> None:
        self.name = name
        self._max_batch = max_batch_size
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.request_ids: list[list[str]] = []
        self.down = False
        self._lock = threading.Lock()

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    def infer(self, batch: np.ndarray, request_ids: Sequence[str]) -> np.ndarray:
        with self._lock:
            self.batches.append(len(batch))
            self.request_ids.append(list(request_ids))
        if self.down:
            raise BackendUnavailable(f"{self.name} is down")
        if self.delay_s:
            time.sleep(self.delay_s)
        if np.any(batch[:, 0, 0, 0] == POISON):
            raise BackendError(f"{self.name} rejected an input")
        logits = np.zeros((len(batch), 1000), dtype=np.float32)
        logits[:, 0] = batch[:, 0, 0, 0]
        return logits

    def start(self) -> None:
        pass

    def ready(self) -> Readiness:
        return Readiness(not self.down, "down" if self.down else "up")

    def close(self) -> None:
        pass


def image(value: float) -> np.ndarray:
    tensor = np.zeros((3, 224, 224), dtype=np.float32)
    tensor[0, 0, 0] = value
    return tensor
