"""One /predict request as named, timed stages: prepare (decode, preprocess) -> route/infer -> postprocess.

What an upload becomes is the decided backend's prepare(); this module never knows which transport runs.
No Flask here: the API layer hands over bytes and gets a contract.Prediction list or a ShimError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from app import metrics, preprocess
from app.admission import Admission
from app.batching import Upstream
from app.capture import Capture
from app.contract import Prediction
from app.images import Upload
from app.routing import RequestContext, Router
from app.scores import Scores, best, softmax

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    model: str
    predictions: list[Prediction]
    backend: str  # which backend answered
    fallback_reason: str | None = None  # why legacy answered a request routed to Triton


def top_k(logits: npt.NDArray[np.float32], labels: tuple[str, ...], k: int,
          scores: Scores = softmax) -> list[Prediction]:
    probs = scores(logits)
    return [Prediction(label=labels[i], class_id=i, score=float(probs[i])) for i in best(probs, k)]


class PredictService:
    def __init__(self, *, model_name: str, spec: preprocess.ImageSpec, labels: tuple[str, ...], top_k: int,
                 router: Router, upstream: Upstream, admission: Admission, capture: Capture | None = None,
                 scores: Scores = softmax) -> None:
        self.model_name = model_name
        self._scores = scores
        self._spec = spec
        self._labels = labels
        self._k = top_k
        self._router = router
        self._upstream = upstream
        self._admission = admission
        self._capture = capture

    def predict(self, data: bytes, ctx: RequestContext) -> Answer:
        upload = Upload(data, self._spec)
        with self._upstream.on_the_way() as arrived:  # a batch may wait for this request while it decodes
            decision = self._router.decide(ctx)
            with self._admission.turn():  # CPU work in arrival order
                try:
                    item = self._router.prepare(upload, decision)
                finally:
                    _publish(upload, decision.backend)
            arrived()
        routed = self._router.infer(upload, item, ctx, decision)  # queue and infer are timed by the batcher
        predictions = _Stages(routed.backend)(
            "postprocess", lambda: top_k(routed.logits, self._labels, self._k, self._scores))
        if self._capture is not None:  # only what was decoded and answered: never a refused upload
            self._capture.offer(data, ctx.request_id)
        return Answer(self.model_name, predictions, routed.backend, routed.fallback_reason)


def _publish(upload: Upload, backend: str) -> None:
    """The decode and preprocess work the request thread did, as the stage metrics of the backend it is for."""
    totals: dict[str, tuple[float, float]] = {}
    for stage, wall, cpu in upload.timings:  # one observation per stage (preprocess is a crop, then a tensor)
        before = totals.get(stage, (0.0, 0.0))
        totals[stage] = (before[0] + wall, before[1] + cpu)
    for stage, (wall, cpu) in totals.items():
        metrics.STAGE_SECONDS.labels(stage, backend).observe(wall)
        metrics.CPU_SECONDS.labels(stage, backend).inc(cpu)
    upload.timings.clear()


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
