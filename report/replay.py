"""Every image through the shim's own LegacyBackend and TritonBackend, in this process, one image per call
(batch size 1: a latency is one image's, never a batch's share). Each image asks both backends in alternating
order (legacy first for even images), so that neither always finds the caches warm.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import importlib
import json
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from app.backends.base import SendAgain
from app.description import check_labels, read_labels, resolve
from app.errors import ShimError
from app.images import Upload
from app.preprocess import ImageSpec
from app.readiness import DEADLINE_S as READINESS_DEADLINE_S
from app.scores import SCORE_FUNCTIONS, Ranking
from app.service import predictions
from app.settings import Settings, SettingsError
from report.compare import BACKENDS, LEGACY, TRITON, Answer, Outcome, from_logits


class Unusable(Exception):
    """The run cannot start (or go on) as asked; the message says why in one line. Exit code 2."""


@dataclass(frozen=True)
class Loaded:
    index: int
    name: str
    upload: Upload  # decoded once (its tensor made at load), what each backend prepares from


def find_files(folder: Path) -> list[tuple[str, Path]]:
    """Every file under `folder` (any name: captures keep uploads under request IDs), in a stable order."""
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(parent) / name
            if path.is_file():
                found.append((path.relative_to(folder).as_posix(), path))
    return found


def load(index: int, name: str, path: Path, spec: ImageSpec) -> Loaded | str:
    """The input, decoded and cropped as the shim does it; or why it is skipped."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    try:
        upload = Upload(data, spec)
        upload.tensor()
        return Loaded(index, name, upload)
    except ShimError as e:  # the contract's invalid_image, empty_image, too_large
        return f"{e.code}: {e.message}"
    except Exception as e:  # a file's edge: a Pillow decoder failing in a way decode() does not translate
        return f"the shim's decoder fails on it ({type(e).__name__}: {e}); the shim would answer 500"


def replay(source: InProcess, files: list[tuple[str, Path]], *, concurrency: int = 1,
           on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Each file through both backends; one Outcome per file, in the files' order (on_outcome sees them so)."""
    outcomes = []
    pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="replay")
    try:  # the first failure ends the run: the files not started yet are cancelled
        for outcome in pool.map(lambda i: _replay_one(source, i, *files[i]), range(len(files))):
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return outcomes


def first_image(files: list[tuple[str, Path]], spec: ImageSpec) -> Loaded | None:
    """The first file that decodes, or None when none does."""
    for index, (name, path) in enumerate(files):
        loaded = load(index, name, path, spec)
        if isinstance(loaded, Loaded):
            return loaded
    return None


def _replay_one(source: InProcess, index: int, name: str, path: Path) -> Outcome:
    loaded = load(index, name, path, source.spec)
    if not isinstance(loaded, Loaded):
        return Outcome(name, skipped=loaded)
    order = BACKENDS if index % 2 == 0 else tuple(reversed(BACKENDS))
    replies = {backend: source.ask(backend, loaded) for backend in order}
    (legacy, legacy_logits), (triton, triton_logits) = replies[LEGACY], replies[TRITON]
    agreement = (None if legacy_logits is None or triton_logits is None
                 else from_logits(legacy_logits, triton_logits, source.k, source.ranking.scores))
    return Outcome(name, legacy=legacy, triton=triton, agreement=agreement)


class InProcess:
    """The shim's own backends, built from its settings (SHIM_*), in this process."""

    def __init__(self, settings: Settings, *, k: int | None = None, legacy_model: Path | None = None,
                 labels: Path | None = None) -> None:
        from app.backends.legacy import LegacyBackend
        from app.wiring import triton_backend

        self.settings = settings
        try:  # the model's description: its preprocessing, labels, scores and top-k, as the shim has them
            self.served = resolve(settings)
            if labels is not None:
                read = read_labels(labels)
                check_labels(self.served.description, read, labels)
                self.served = dataclasses.replace(self.served, labels=read, labels_path=labels)
        except SettingsError as e:
            raise Unusable(f"{e} (--model-repository, --model, --labels or their SHIM_* settings)") from None
        if legacy_model is not None:
            self.served = dataclasses.replace(self.served, legacy_model_path=legacy_model)
        description = self.served.description
        self.spec, self.labels = ImageSpec.of(self.served.description), self.served.labels
        self.k = k if k is not None else self.served.top_k
        self.ranking = Ranking(self.k, SCORE_FUNCTIONS[description.scores])
        if not self.served.legacy_model_path.is_file():
            raise Unusable(f"legacy model {self.served.legacy_model_path} does not exist (--legacy-model, or "
                           "make export)")
        if self.k > len(self.labels):
            raise Unusable(f"--top-k {self.k} is more than the {len(self.labels)} classes of {self.served.labels_path}")
        self.legacy = LegacyBackend(model_path=self.served.legacy_model_path, threads=0,
                                    max_batch_size=1, image_shape=self.spec.shape,
                                    load_timeout_s=300, classes=description.classes)
        self.triton = triton_backend(settings, self.served, max_batch_size=1)
        self._triton_info = ""

    def check(self) -> None:
        state = self.triton.ready()  # within about READINESS_DEADLINE_S, however Triton is down
        if not state.ready:
            raise Unusable(f"Triton cannot be used: {state.detail}")
        self._triton_info = triton_info(self.settings.triton_host_port, self.settings.model_name,
                                        timeout_s=READINESS_DEADLINE_S + 2)
        self.legacy.start()  # torch loads in the background while the first image decodes

    def warm_up(self, image: Loaded, *, calls: int) -> None:
        """Uncounted calls per backend (TorchScript optimises a graph over its first runs); Unusable if one fails."""
        for _ in range(calls):
            for backend in BACKENDS:
                answer, _ = self.ask(backend, image)
                if not answer.ok:
                    raise Unusable(f"the {backend} path does not answer: {answer.error}")

    def ask(self, backend: str, image: Loaded) -> tuple[Answer, npt.NDArray[np.float32] | None]:
        """The answer, and its whole row of logits when there is one."""
        chosen = self.legacy if backend == LEGACY else self.triton
        started = time.perf_counter()
        try:  # prepared as the shim prepares it: the encoded transport sends the upload as it came
            row = chosen.infer([chosen.prepare(image.upload)], [f"report-{image.index}-{backend}"])[0]
            if isinstance(row, SendAgain):  # Triton's decoder refused it: decoded here, as the shim would
                row = chosen.infer([row.make()], [f"report-{image.index}-{backend}"])[0]
            if isinstance(row, ShimError):
                raise row
        except ShimError as e:  # the backends raise nothing else
            return Answer(backend, time.perf_counter() - started, error=f"{e.code}: {e.message}"), None
        seconds = time.perf_counter() - started
        return Answer(backend, seconds, tuple(predictions(self.ranking.rank([row])[0], self.labels))), row

    def describe(self) -> list[tuple[str, str]]:
        s = self.settings
        return [
            ("Source", "in-process: the shim's LegacyBackend (TorchScript in this process) and TritonBackend, "
                       "one image per call (batch size 1); times are each backend call alone, after the shim's "
                       "own decode and preprocess, which both paths share"),
            ("Triton", f"{s.triton_host_port}: {self._triton_info}; transport {self.triton.transport}"),
            ("Model", f"{self.served.description.path}: {self.served.description}"),
            ("Legacy model", describe_model(self.served.legacy_model_path)),
            ("Labels", f"{self.served.labels_path} ({len(self.labels)} classes); top-{self.k} compared"),
        ]

    def close(self) -> None:
        self.triton.close()
        self.legacy.close()


def triton_info(host_port: str, model: str, *, timeout_s: float) -> str:
    """Triton's server version and the versions of `model` it serves, from its own HTTP API."""
    base = f"http://{host_port}/v2"
    try:
        server = _get_json(base, timeout_s)
        meta = _get_json(f"{base}/models/{urllib.parse.quote(model)}", timeout_s)
    except (OSError, ValueError, http.client.HTTPException) as e:
        return f"server and model versions unknown ({e})"
    versions = ", ".join(str(v) for v in meta.get("versions", [])) or "?"
    return (f"{server.get('name', 'triton')} server {server.get('version', '?')}; model '{model}' "
            f"({meta.get('platform') or meta.get('backend') or '?'}), versions served: {versions}")


def describe_model(path: Path) -> str:
    """The model file, its size and hash, and its export info."""
    try:
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256")
        text = f"{path} ({path.stat().st_size / 1e6:.1f} MB, sha256 {digest.hexdigest()[:16]})"
    except OSError as e:
        return f"{path} (cannot be read: {e.strerror or e})"
    try:  # what modelrepo/export.py stored in the file, when that tool is at hand (the repo, the shim's image)
        tool: Any = importlib.import_module("modelrepo.export")
    except ImportError:
        return text
    info = tool.read_export_info(path)
    if isinstance(info, dict) and info:
        text += "; export info: " + ", ".join(f"{k} {v}" for k, v in info.items())
    return text


def _get_json(url: str, timeout_s: float) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        body = json.loads(answer.read())
    if not isinstance(body, dict):
        raise ValueError(f"{url} answered {type(body).__name__}, not a JSON object")
    return body
