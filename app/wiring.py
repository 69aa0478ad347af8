"""Build the shim's objects from settings: backends, batchers, router, service. No Flask here."""

from __future__ import annotations

from dataclasses import dataclass

from app import metrics
from app.batching import Batcher, Upstream
from app.breaker import CircuitBreaker
from app.preprocess import ImageSpec, configure_pillow
from app.routing import MODES_USING_LEGACY, Guardrails, Router
from app.service import PredictService, load_labels
from app.settings import Settings
from app.shadow import ShadowRunner
from app.traffic import TrafficFlag, TrafficState


@dataclass(frozen=True)
class Shim:
    settings: Settings
    service: PredictService
    router: Router

    def close(self) -> None:
        self.router.close()


def build_shim(settings: Settings) -> Shim:
    # Imported here, not at the top: importing the app package (gunicorn's master does) stays light.
    from app.backends.legacy import LegacyBackend
    from app.backends.triton import TritonBackend

    metrics.initialize()
    spec = ImageSpec(max_pixels=settings.max_image_pixels)
    configure_pillow(spec)
    labels = load_labels(settings.labels_path)
    upstream = Upstream()
    delay_s = settings.batch_delay_ms / 1000
    triton = TritonBackend(
        url=settings.triton_host_port, model=settings.model_name, version=settings.model_version,
        connect_timeout_s=settings.triton_connect_timeout_s, network_timeout_s=settings.triton_timeout_s,
        image_shape=spec.shape, classes=len(labels), max_batch_size=settings.max_batch_size)
    legacy = LegacyBackend(model_path=settings.legacy_model_path, threads=settings.legacy_threads,
                           max_batch_size=settings.max_batch_size, image_shape=spec.shape)
    # A request may wait for its batch to be sent and then for the backend: both bounded.
    result_timeout_s = settings.triton_timeout_s * 2 + delay_s + 5
    batchers = {
        "triton": Batcher(triton, upstream, max_delay_s=delay_s, senders=settings.batch_senders,
                          result_timeout_s=result_timeout_s),
        # In-process torch already uses every core for one batch: one sender.
        "legacy": Batcher(legacy, upstream, max_delay_s=delay_s, senders=1, result_timeout_s=result_timeout_s),
    }
    breaker = CircuitBreaker("triton", failures=settings.breaker_failures, reset_s=settings.breaker_reset_s)
    shadow = ShadowRunner(batchers["triton"], breaker, max_inflight=settings.shadow_max_inflight,
                          timeout_s=settings.shadow_timeout_s, tolerance=settings.shadow_tolerance,
                          top_k=settings.top_k, logs_per_minute=settings.shadow_log_per_minute)
    initial = TrafficState(mode=settings.mode, canary_percent=settings.canary_percent,
                           shadow_percent=settings.shadow_percent)
    flag = TrafficFlag(settings.flag_file, initial, poll_s=settings.flag_poll_s)
    guardrails = Guardrails(fallback=settings.fallback, auto_rollback=settings.auto_rollback,
                            rollback_error_rate=settings.rollback_error_rate,
                            rollback_window_s=settings.rollback_window_s,
                            rollback_min_requests=settings.rollback_min_requests)
    router = Router(flag=flag, batchers=batchers, breaker=breaker, shadow=shadow, guardrails=guardrails)
    if flag.current().mode in MODES_USING_LEGACY or settings.fallback:
        legacy.start()  # load now, in the background, rather than on the first request
    service = PredictService(model_name=settings.model_name, spec=spec, labels=labels, top_k=settings.top_k,
                             router=router, upstream=upstream)
    return Shim(settings=settings, service=service, router=router)
