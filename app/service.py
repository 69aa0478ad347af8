"""One /predict request as named, timed stages: prepare (decode, preprocess) -> route/infer -> postprocess.

The postprocess stage (scores, top k) runs once per batch in the batch sender (app/batching.py); here the
request's ranked row only becomes the contract's predictions.

What an upload becomes is the decided backend's prepare(); this module never knows which transport runs.
No Flask here: the API layer hands over bytes and gets a contract.Prediction list or a ShimError.
"""

from __future__ import annotations

from dataclasses import dataclass

from app import metrics, preprocess
from app.admission import Admission
from app.batching import Upstream
from app.capture import Capture
from app.contract import Prediction
from app.images import Upload
from app.routing import RequestContext, Router
from app.scores import Ranked


@dataclass(frozen=True)
class Answer:
    model: str
    predictions: list[Prediction]
    backend: str  # which backend answered
    fallback_reason: str | None = None  # why legacy answered a request routed to Triton


def predictions(ranked: Ranked, labels: tuple[str, ...]) -> list[Prediction]:
    pairs = zip(ranked.classes, ranked.scores, strict=True)
    return [Prediction(label=labels[i], class_id=i, score=score) for i, score in pairs]


class PredictService:
    def __init__(self, *, model_name: str, spec: preprocess.ImageSpec, labels: tuple[str, ...],
                 router: Router, upstream: Upstream, admission: Admission, capture: Capture | None = None) -> None:
        self.model_name = model_name
        self._spec = spec
        self._labels = labels
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
        routed = self._router.infer(upload, item, ctx, decision)  # queue, infer, postprocess: timed by the batcher
        answer = predictions(routed.ranked, self._labels)
        if self._capture is not None:  # only what was decoded and answered: never a refused upload
            self._capture.offer(data, ctx.request_id)
        return Answer(self.model_name, answer, routed.backend, routed.fallback_reason)


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
