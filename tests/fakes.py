"""Fakes at the Backend seam, for testing what sits above it (batcher, router, API). Never Triton itself."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.backends.base import Readiness
from app.errors import BackendError, BackendUnavailable, ShimError
from app.images import Upload
from app.preprocess import ImageSpec

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

    def prepare(self, upload: Upload) -> np.ndarray:
        return upload.tensor()

    def infer(self, items: Sequence[Any], request_ids: Sequence[str]) -> Any:
        batch = np.stack(items)
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
    """The encoded transport's own class (app/backends/triton/encoded.py: which uploads go as they came, what
    happens to a row its decoder refuses) with Triton replaced: an upload's logits hold its length in class 1
    (tensors: EchoBackend's answer); uploads that Pillow cannot decode whole (a truncated JPEG), and those in
    `refuse`, come back not readable, as Triton's decoder answers a file it cannot read."""

    def __init__(self, name: str = "triton") -> None:
        from app.backends.triton.encoded import EncodedTransport
        from app.backends.triton.transport import Target

        super().__init__(name)
        self.uploads: list[bytes] = []
        self.tensors = 0
        self.refuse: set[bytes] = set()
        fake = self

        class Offline(EncodedTransport):
            def _send(self, clients: Any, uploads: list[bytes], request_id: str) -> tuple[Any, Any]:
                fake.uploads.extend(uploads)
                logits = np.zeros((len(uploads), CLASSES), dtype=np.float32)
                logits[:, 1] = [len(u) for u in uploads]
                return logits, np.array([u not in fake.refuse and _decodes(u) for u in uploads])

        class Tensors:
            def send(self, clients: Any, batch: np.ndarray, request_id: str) -> Any:
                fake.tensors += len(batch)
                return EchoBackend.infer(fake, list(batch), [request_id] * len(batch))

        self.transport = Offline(Target(url="fake", model="m", version="", crop=(224, 224), classes=CLASSES,
                                        encoded_model="m_encoded"))
        self.transport._tensors = Tensors()  # type: ignore[assignment]

    def prepare(self, upload: Upload) -> Any:
        return self.transport.prepare(upload)

    def infer(self, items: Sequence[Any], request_ids: Sequence[str]) -> list[np.ndarray | ShimError]:
        if self.down:
            raise BackendUnavailable(f"{self.name} is down", backend=self.name)
        return self.transport.infer(None, items, ",".join(request_ids))  # type: ignore[arg-type]


def _decodes(data: bytes) -> bool:
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as picture:
            picture.load()
    except (OSError, ValueError, SyntaxError):
        return False
    return True


def item(value: float) -> np.ndarray:
    """A tensor whose first value is `value` (what EchoBackend answers with): what its prepare() makes."""
    tensor = np.zeros((3, 224, 224), dtype=np.float32)
    tensor[0, 0, 0] = value
    return tensor


def image(value: float) -> Upload:
    """An upload, decoded already, whose tensor's first value is `value`."""
    return Upload(b"", SPEC, pixels=np.zeros((224, 224, 3), dtype=np.uint8), tensor=item(value))


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
