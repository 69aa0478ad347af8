"""Build the shim's objects from settings: backends, batchers, router, service. No Flask here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app import metrics
from app.admission import Admission
from app.backends.base import Backend, MayLack
from app.batching import Batcher, Upstream, triton_senders
from app.breaker import CircuitBreaker
from app.capabilities import check_start
from app.capture import Capture
from app.description import Served, pair, resolve
from app.preprocess import ImageSpec, configure_pillow
from app.readiness import DEADLINE_S as READINESS_DEADLINE_S
from app.readiness import SharedCheck
from app.rollback import AutoRollback
from app.routing import LEGACY, TRITON, Router
from app.scores import SCORE_FUNCTIONS, Ranking
from app.service import PredictService
from app.settings import MODES_USING_LEGACY, Settings
from app.shadow import ShadowRunner
from app.traffic import TrafficFlag, TrafficState

if TYPE_CHECKING:
    from app.backends.triton import TritonBackend

TRITON_CONNECT_TIMEOUT_S = 1.0  # a Triton that does not accept a connection within this is down


@dataclass(frozen=True)
class Shim:
    settings: Settings
    service: PredictService
    router: Router
    admission: Admission

    def close(self) -> None:
        self.router.close()


def triton_backend(settings: Settings, served: Served, *, max_batch_size: int | None = None) -> TritonBackend:
    """The Triton backend of these settings and this model's description: the shim's, and the migration report's
    (report/replay.py, one image per call). Every model name, tensor shape and preprocessing parameter it
    checks at readiness comes from the description, the ensembles' names too."""
    from app.backends.triton import Target, TritonBackend, transport_for

    description = served.description
    target = Target(url=settings.triton_host_port, model=description.name, version=settings.model_version,
                    crop=pair(description.crop), classes=description.classes, parameters=description.parameters(),
                    uint8_model=description.uint8_model,
                    encoded_model=description.encoded_model,
                    decode_parameters=description.decode_parameters(), encoded_refusal=description.encoded_refusal())
    return TritonBackend(transport_for(settings)(target), connect_timeout_s=TRITON_CONNECT_TIMEOUT_S,
                         network_timeout_s=settings.triton_timeout_s, readiness_timeout_s=READINESS_DEADLINE_S,
                         max_batch_size=settings.max_batch_size if max_batch_size is None else max_batch_size)


def build_backends(settings: Settings, served: Served) -> dict[str, Backend]:
    """The real backends. Imported here, not at the top: importing the app package (gunicorn's master
    does) stays light, and tritonclient is created only in the worker that uses it."""
    from app.backends.legacy import LegacyBackend

    return {
        TRITON: triton_backend(settings, served),
        LEGACY: LegacyBackend(model_path=served.legacy_model_path, threads=0,  # torch's own: OMP_NUM_THREADS
                              max_batch_size=settings.max_batch_size,
                              image_shape=ImageSpec.of(served.description).shape,
                              classes=served.description.classes),
    }


def build_shim(settings: Settings, backends: Mapping[str, Backend] | None = None) -> Shim:
    """Everything a worker needs; `backends` replaces the real ones (tests pass fakes at this seam)."""
    metrics.initialize()
    served = resolve(settings)  # the model's description (SHIM_MODEL_REPOSITORY/SHIM_MODEL_NAME/model.toml)
    scores = SCORE_FUNCTIONS[served.description.scores]
    spec = ImageSpec.of(served.description)
    configure_pillow(spec)
    chosen = dict(backends) if backends is not None else build_backends(settings, served)
    legacy = chosen[LEGACY]
    legacy_lacks = legacy.missing if isinstance(legacy, MayLack) else lambda: None
    check_start(settings, legacy_lacks())  # gunicorn's master checked it already; other servers stop here
    upstream = Upstream()
    delay_s = settings.batch_delay_ms / 1000
    admission = Admission(max_pending=settings.max_pending)
    ranking = Ranking(served.top_k, scores)
    batchers = {
        TRITON: Batcher(chosen[TRITON], upstream, ranking=ranking, max_delay_s=delay_s, turn=admission.turn,
                        senders=triton_senders(served.description.instances, settings.workers)),
        # In-process torch already uses every core for one batch: one sender.
        LEGACY: Batcher(chosen[LEGACY], upstream, ranking=ranking, max_delay_s=delay_s, senders=1),
    }
    triton_check = SharedCheck(chosen[TRITON].ready)

    def triton_healthy() -> bool:  # the breaker's watcher: Triton answered a check made for it
        checked = triton_check()
        return checked.fresh and checked.readiness.ready

    breaker = CircuitBreaker(TRITON, health=triton_healthy)
    # A shadow call waits on Triton as long as a client's request would, never longer.
    shadow = ShadowRunner(batchers[TRITON], breaker, top_k=served.top_k, timeout_s=settings.triton_timeout_s,
                          scores=scores)
    flag = TrafficFlag(settings.flag_file, TrafficState(mode=settings.mode), legacy_lacks=legacy_lacks)
    rollback = AutoRollback(flag) if settings.auto_rollback else None
    # A fallback decode for the legacy backend takes a decode turn like any other (the decode bound).
    router = Router(flag=flag, batchers=batchers, breaker=breaker, shadow=shadow, fallback=settings.fallback,
                    timeout_s=settings.triton_timeout_s, rollback=rollback, triton_check=triton_check,
                    turn=admission.turn)
    if flag.current().mode in MODES_USING_LEGACY or settings.fallback:
        chosen[LEGACY].start()  # load now, in the background, rather than on the first request
    capture = Capture(settings.capture_dir) if settings.capture_dir else None
    service = PredictService(model_name=served.name, spec=spec, labels=served.labels,
                             router=router, upstream=upstream, admission=admission, capture=capture)
    return Shim(settings=settings, service=service, router=router, admission=admission)
