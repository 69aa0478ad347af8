"""Fakes at the Backend seam, for testing what sits above it (batcher, router, API). Never Triton itself."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.backends.base import ENCODED, FP32, Readiness
from app.errors import BackendError, BackendUnavailable, DecodeRefused
from app.preprocess import ImageSpec, Prepared

POISON = -7.0  # an image whose first value is POISON makes the fake fail the batch it is in
CLASSES = 1000
SPEC = ImageSpec()


class EchoBackend:
    """Logits [N, 1000] whose first value is the first value of each image: answers are traceable.

    `down` makes every call fail as unavailable; `hang` makes calls block until it is cleared (a Triton
    that accepts and never answers); `broken` makes calls raise a bug's exception (not a BackendError).
    """

    def __init__(self, name: str = "fake", max_batch_size: int = 32, delay_s: float = 0.0) -> None:
        self.name = name
        self._max_batch = max_batch_size
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.request_ids: list[list[str]] = []
        self.down = False
        self.broken = False
        self.hang = threading.Event()  # set: calls block until it is cleared
        self.started = 0
        self.lacks: str | None = None  # what it lacks to run here at all (as the legacy backend without torch)
        self._lock = threading.Lock()

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def input_kind(self) -> str:
        return FP32

    def infer(self, images: Sequence[Prepared], request_ids: Sequence[str]) -> np.ndarray:
        batch = np.stack([i.fp32() for i in images])
        with self._lock:
            self.batches.append(len(batch))
            self.request_ids.append(list(request_ids))
        while self.hang.is_set():
            time.sleep(0.005)
        if self.down:
            raise BackendUnavailable(f"{self.name} is down", backend=self.name)
        if self.broken:
            raise ZeroDivisionError("a bug in the backend")
        if self.delay_s:
            time.sleep(self.delay_s)
        if np.any(batch[:, 0, 0, 0] == POISON):
            raise BackendError(f"{self.name} rejected an input", backend=self.name)
        logits = np.zeros((len(batch), CLASSES), dtype=np.float32)
        logits[:, 0] = batch[:, 0, 0, 0]
        return logits

    def start(self) -> None:
        self.started += 1

    def missing(self) -> str | None:
        return self.lacks

    def ready(self) -> Readiness:
        if self.hang.is_set() or self.down:
            return Readiness(False, f"{self.name} is down")
        return Readiness(True, f"{self.name} is up")

    def close(self) -> None:
        self.hang.clear()


class EncodedEcho(EchoBackend):
    """A backend of the encoded transport's kind: it takes uploads as their bytes (one per call) and other
    images as FP32 tensors. An upload's logits hold its length in class 1 (tensors: EchoBackend's answer);
    uploads that Pillow cannot decode whole (a truncated JPEG), and those in `refuse`, get DecodeRefused, as
    Triton's decoder answers a file it cannot read."""

    def __init__(self, name: str = "triton") -> None:
        super().__init__(name)
        self.uploads: list[bytes] = []
        self.tensors = 0
        self.refuse: set[bytes] = set()

    @property
    def input_kind(self) -> str:
        return ENCODED

    def infer(self, images: Sequence[Prepared], request_ids: Sequence[str]) -> np.ndarray:
        rows = []
        for one, request_id in zip(images, request_ids, strict=True):
            if one.encoded is None:
                self.tensors += 1
                rows.append(super().infer([one], [request_id])[0])
                continue
            if self.down:
                raise BackendUnavailable(f"{self.name} is down", backend=self.name)
            self.uploads.append(one.encoded)
            if one.encoded in self.refuse or not _decodes(one.encoded):
                raise DecodeRefused("[decode_refused] the decoder cannot read this image")
            row = np.zeros(CLASSES, dtype=np.float32)
            row[1] = len(one.encoded)
            rows.append(row)
        return np.stack(rows)


def _decodes(data: bytes) -> bool:
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as picture:
            picture.load()
    except (OSError, ValueError, SyntaxError):
        return False
    return True


def image(value: float) -> Prepared:
    """A prepared image whose tensor's first value is `value` (what EchoBackend answers with)."""
    tensor = np.zeros((3, 224, 224), dtype=np.float32)
    tensor[0, 0, 0] = value
    return Prepared(np.zeros((224, 224, 3), dtype=np.uint8), SPEC, tensor)


def write_labels(path: Path) -> Path:
    path.write_text("".join(f"class {i}\n" for i in range(CLASSES)))
    return path


def write_model_repo(root: Path) -> Path:
    """A model repository with triton_repo's resnet50 description and CLASSES labels: what the shim reads at start
    (labels.txt is made by the export, so a fresh clone has none)."""
    import shutil

    from tests.support import ROOT

    folder = root / "resnet50"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "triton_repo" / "resnet50" / "model.toml", folder / "model.toml")
    write_labels(folder / "labels.txt")
    return root


def with_traffic(values: dict[str, Any]) -> dict[str, Any]:
    """Settings values for a test app; a canary or shadow share in them goes into the flag file, where
    shim-traffic puts it (it is no setting)."""
    shares = {k: values.pop(k) for k in ("canary_percent", "shadow_percent") if k in values}
    if shares:
        mode = values.get("mode", "triton")
        values["flag_file"].write_text(json.dumps({"mode": str(mode), **shares}))
    return values
