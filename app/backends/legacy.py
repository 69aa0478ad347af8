"""The in-process TorchScript model: what the legacy Flask app did, kept as a backend.

torch is imported and the model loaded in a background thread started after the worker forked, so a
worker answers /healthz at once and /readyz tells the truth while the model loads.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from app.backends.base import Readiness
from app.capabilities import FindSpec, legacy_lacks
from app.errors import BackendError, BackendUnavailable
from app.images import Upload

log = logging.getLogger(__name__)


class LegacyBackend:
    name = "legacy"

    def __init__(self, *, model_path: Path, threads: int, max_batch_size: int, image_shape: Sequence[int],
                 load_timeout_s: float = 120, classes: int | None = None,
                 find_spec: FindSpec = importlib.util.find_spec) -> None:
        self.model_path = model_path
        self._classes = classes  # what the model's description says it answers; checked on its first run
        self._find_spec = find_spec
        self._image_shape = tuple(image_shape)
        self._threads = threads
        self._max_batch = max_batch_size
        self._load_timeout_s = load_timeout_s
        self._model: Any = None
        self._error: str | None = None
        self._loaded = threading.Event()
        self._started = False
        self._lock = threading.Lock()

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    def missing(self) -> str | None:
        """torch or the model file, when either is missing here (the slim image has no torch)."""
        return legacy_lacks(self.model_path, self._find_spec)

    def start(self) -> None:
        if self._started:  # the hot path: every request routed to legacy calls this
            return
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._load, name="legacy-model-load", daemon=True).start()

    def ready(self) -> Readiness:
        if not self._started:
            return Readiness(False, f"legacy model {self.model_path} is not loaded (no traffic mode needed it yet)")
        if not self._loaded.is_set():
            return Readiness(False, f"legacy model {self.model_path} is loading")
        if self._model is None:
            return Readiness(False, self._error or f"legacy model {self.model_path} failed to load")
        return Readiness(True, f"legacy model {self.model_path} is loaded")

    def prepare(self, upload: Upload) -> npt.NDArray[np.float32]:
        return upload.tensor()

    def infer(self, items: Sequence[npt.NDArray[np.float32]], request_ids: Sequence[str]) -> npt.NDArray[np.float32]:
        self.start()
        if not self._loaded.wait(self._load_timeout_s) or self._model is None:
            raise BackendUnavailable(self._error or f"legacy model {self.model_path} is still loading",
                                     backend=self.name)
        import torch

        try:
            batch = torch.from_numpy(np.stack(items))
            with torch.inference_mode():
                return np.asarray(self._model(batch).numpy(), dtype=np.float32)
        except RuntimeError as e:  # torch reports every failure of forward() as RuntimeError
            raise BackendError(f"legacy model failed: {e}", backend=self.name) from e

    def close(self) -> None:
        self._model = None

    def _load(self) -> None:
        try:
            self._model = self._build()
            log.info("legacy model %s loaded", self.model_path)
        except ImportError as e:
            self._error = (f"legacy model {self.model_path} cannot load: {e.name or 'torch'} is not installed here "
                           "(the image was built without the legacy backend: build it with WITH_LEGACY=1, or "
                           "pip install '.[legacy]')")
            log.error("%s", self._error)
        except Exception as e:  # the load thread's outermost frame: whatever failed, readiness must say so
            self._error = f"legacy model {self.model_path} failed to load: {type(e).__name__}: {e}"
            log.error("%s", self._error)
        finally:
            self._loaded.set()

    def _build(self) -> Any:
        import torch

        if not self.model_path.is_file():
            raise FileNotFoundError(f"{self.model_path} does not exist; run `make export` (or `shim-export "
                                    "--model <name>`), or point SHIM_MODEL_REPOSITORY at a repository that has it")
        if self._threads:
            torch.set_num_threads(self._threads)
        model = torch.jit.load(str(self.model_path), map_location="cpu").eval()  # type: ignore[no-untyped-call]
        with torch.inference_mode():  # the first call optimises the graph; no client should pay for it
            out = model(torch.zeros((1, *self._image_shape)))
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        if self._classes is not None and got != [1, self._classes]:
            raise ValueError(f"it answers {got} for an input {[1, *self._image_shape]}, where the model's description "
                             f"says [output] classes = {self._classes}: export the model the description describes "
                             "(modelrepo/export.py), or fix the description")
        return model
