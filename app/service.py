"""One /predict request as named, timed stages: decode -> preprocess -> route/infer -> postprocess.

With the encoded transport an upload whose header says Triton can decode it (app/sniff.py) skips decode and
preprocess here: its bytes go to Triton as they came. Any other upload, and one Triton's decoder refuses,
goes through the stages as before, so every answer is the legacy app's.

No Flask here: the API layer hands over bytes and gets a contract.Prediction list or a ShimError.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from app import metrics, preprocess, sniff
from app.admission import Admission
from app.backends.base import ENCODED, UINT8
from app.batching import Upstream
from app.capture import Capture
from app.contract import Prediction
from app.errors import DecodeRefused
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
        with self._upstream.on_the_way() as arrived:  # a batch may wait for this request while it decodes
            decision = self._router.decide(ctx)
            stage = _Stages(decision.backend)
            kind = self._router.input_kind(decision)
            with self._admission.turn():  # CPU work in arrival order
                prepared = self._forwarded(data) if kind == ENCODED else None
                if prepared is None:  # the uint8 transport's backend normalises the pixels itself
                    prepared = self._decoded(data, stage, fp32=kind != UINT8)
                    if decision.shadow and self._router.triton_kind == ENCODED and \
                            sniff.cpu_reason(data, self._spec) is None:
                        prepared = dataclasses.replace(prepared, encoded=data)  # shadowed as it would be sent
            arrived()
        try:
            routed = self._router.infer(prepared, ctx, decision)  # queue and infer are timed by the batcher
        except DecodeRefused:  # Triton's decoder could not read it: Pillow's answer, the legacy app's
            metrics.ENCODED_CPU_PATH.labels("decoder_refused").inc()
            with self._admission.turn():
                prepared = self._decoded(data, stage, fp32=True)
            routed = self._router.infer(prepared, ctx, decision)
        predictions = stage("postprocess", lambda: top_k(routed.logits, self._labels, self._k, self._scores))
        if self._capture is not None:  # only what was decoded and answered: never a refused upload
            self._capture.offer(data, ctx.request_id)
        return Answer(self.model_name, predictions, routed.backend, routed.fallback_reason)

    def _decoded(self, data: bytes, stage: _Stages, *, fp32: bool) -> preprocess.Prepared:
        image = stage("decode", lambda: preprocess.decode(data, self._spec))
        return stage("preprocess", lambda: preprocess.prepare(image, self._spec, fp32=fp32))

    def _forwarded(self, data: bytes) -> preprocess.Prepared | None:
        """The upload as it came, when its header says Triton decodes it; None (counted) when the shim must."""
        reason = sniff.cpu_reason(data, self._spec)
        if reason is None:
            return preprocess.forwarded(data, self._spec)
        metrics.ENCODED_CPU_PATH.labels(reason).inc()
        return None


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
