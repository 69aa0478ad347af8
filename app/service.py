"""One /predict request as named, timed stages: decode -> preprocess -> route/infer -> postprocess.

No Flask here: the API layer hands over bytes and gets a contract.Prediction list or a ShimError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from app import metrics, preprocess
from app.admission import Admission
from app.backends.base import FP32
from app.batching import Upstream
from app.capture import Capture
from app.contract import Prediction
from app.routing import RequestContext, Router
from app.scores import best, softmax

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    model: str
    predictions: list[Prediction]
    backend: str  # which backend answered
    fallback_reason: str | None = None  # why legacy answered a request routed to Triton


def load_labels(path: Path) -> tuple[str, ...]:
    try:
        labels = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    except OSError as e:
        raise FileNotFoundError(f"labels file {path} cannot be read ({e.strerror}); run `make export` "
                                "or set SHIM_LABELS_PATH") from e
    if not labels:
        raise ValueError(f"labels file {path} is empty")
    return labels


def top_k(logits: npt.NDArray[np.float32], labels: tuple[str, ...], k: int) -> list[Prediction]:
    probs = softmax(logits)
    return [Prediction(label=labels[i], class_id=i, score=float(probs[i])) for i in best(probs, k)]


class PredictService:
    def __init__(self, *, model_name: str, spec: preprocess.ImageSpec, labels: tuple[str, ...], top_k: int,
                 router: Router, upstream: Upstream, admission: Admission, capture: Capture | None = None) -> None:
        self.model_name = model_name
        self._spec = spec
        self._labels = labels
        self._k = top_k
        self._router = router
        self._upstream = upstream
        self._admission = admission
        self._capture = capture

    def predict(self, data: bytes, ctx: RequestContext) -> Answer:
        with self._upstream.on_the_way() as arrived:  # a batch may wait for this request while it decodes
            decision = self._router.decide(ctx)
            stage = _Stages(decision.backend)
            with self._admission.turn():  # CPU work in arrival order
                image = stage("decode", lambda: preprocess.decode(data, self._spec))
                fp32 = self._router.input_kind(decision) == FP32  # else the backend normalises the pixels itself
                prepared = stage("preprocess", partial(preprocess.prepare, image, self._spec, fp32=fp32))
                # The decoded image is up to SHIM_MAX_IMAGE_PIXELS x 3 bytes (120 MB at 40 M pixels): freed now,
                # not held while the request waits for its backend (python -m bench --memory, 64 such uploads at
                # once in shadow mode: a worker's peak was 4.9 GiB while it was held, 2.1 GiB now).
                del image
            arrived()
        routed = self._router.infer(prepared, ctx, decision)  # queue and infer are timed by the batcher
        predictions = stage("postprocess", lambda: top_k(routed.logits, self._labels, self._k))
        if self._capture is not None:  # only what was decoded and answered: never a refused upload
            self._capture.offer(data, ctx.request_id)
        return Answer(self.model_name, predictions, routed.backend, routed.fallback_reason)


class _Stages:
    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __call__(self, name: str, work: Callable[[], T]) -> T:
        started, cpu = time.perf_counter(), time.thread_time()  # wall time for latency, this thread's CPU for cost
        try:
            return work()
        finally:
            metrics.STAGE_SECONDS.labels(name, self.backend).observe(time.perf_counter() - started)
            metrics.CPU_SECONDS.labels(name, self.backend).inc(time.thread_time() - cpu)
