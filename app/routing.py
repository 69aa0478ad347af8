"""Which backend answers a request: the traffic mode in force, applied per request, with guardrails.

    legacy  the in-process model answers
    triton  Triton answers
    shadow  legacy answers; a share of requests is also sent to Triton off the request path, compared
    canary  a sticky share of clients (by targeting key) is answered by Triton, the rest by legacy

In triton and canary modes a failed Triton call is answered by legacy when fallback is on (counted);
a circuit breaker stops calling Triton after repeated failures and probes it after a cool-down; and,
when enabled, a Triton error rate over the threshold drops the canary share to 0 for every worker.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from app import metrics
from app.backends.base import Backend, Readiness
from app.batching import Admission, Batcher
from app.breaker import CircuitBreaker
from app.errors import BackendError, BackendUnavailable
from app.settings import Mode
from app.shadow import ShadowRunner
from app.traffic import FlagNotWritable, TrafficFlag, TrafficState, bucket

log = logging.getLogger(__name__)
LEGACY, TRITON = "legacy", "triton"
MODES_USING_LEGACY = {Mode.LEGACY, Mode.SHADOW, Mode.CANARY}


class CircuitOpen(BackendUnavailable):
    code = "backend_unavailable"


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    routing_key: str  # who the client is, for sticky canary assignment
    forced_backend: str | None = None  # the QA override header, when enabled
    notes: dict[str, str] = field(default_factory=dict)  # what happened to it, for logs and metrics


@dataclass(frozen=True)
class Decision:
    mode: Mode
    backend: str  # the backend asked first
    shadow: bool = False
    fallback: bool = False  # may legacy answer if Triton fails?


@dataclass(frozen=True, kw_only=True)
class Guardrails:
    fallback: bool
    auto_rollback: bool
    rollback_error_rate: float
    rollback_window_s: float
    rollback_min_requests: int


class ErrorWindow:
    """Outcomes of Triton calls over the last `window_s` seconds, in one worker."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, bool]] = deque()
        self._lock = threading.Lock()

    def record(self, ok: bool) -> tuple[int, int]:
        """Add one outcome; return (failures, calls) within the window."""
        now = time.monotonic()
        with self._lock:
            self._events.append((now, ok))
            while self._events and now - self._events[0][0] > self._window_s:
                self._events.popleft()
            failures = sum(1 for _, good in self._events if not good)
            return failures, len(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


class Router:
    def __init__(self, *, flag: TrafficFlag, batchers: dict[str, Batcher], breaker: CircuitBreaker,
                 shadow: ShadowRunner, guardrails: Guardrails) -> None:
        self.flag = flag
        self.breaker = breaker
        self._batchers = batchers
        self._shadow = shadow
        self._guard = guardrails
        self._errors = ErrorWindow(guardrails.rollback_window_s)

    @property
    def mode(self) -> Mode:
        return self.flag.current().mode

    @property
    def fallback(self) -> bool:
        return self._guard.fallback

    def decide(self, ctx: RequestContext) -> Decision:
        state = self.flag.current()
        if ctx.forced_backend in (LEGACY, TRITON):
            decision = Decision(state.mode, ctx.forced_backend)
        elif state.mode is Mode.LEGACY:
            decision = Decision(state.mode, LEGACY)
        elif state.mode is Mode.TRITON:
            decision = Decision(state.mode, TRITON, fallback=self._guard.fallback)
        elif state.mode is Mode.SHADOW:
            decision = Decision(state.mode, LEGACY, shadow=random.random() * 100 < state.shadow_percent)
        else:
            to_triton = bucket(ctx.routing_key) < state.canary_percent
            decision = Decision(state.mode, TRITON if to_triton else LEGACY, fallback=self._guard.fallback)
        if decision.backend == LEGACY or decision.fallback:
            self._legacy().start()  # a switch to a mode that needs it: load it now, once
        return decision

    def infer(self, tensor: npt.NDArray[np.float32], ctx: RequestContext, decision: Decision,
              admission: Admission | None = None) -> npt.NDArray[np.float32]:
        """Logits from the decided backend (or its fallback); records which one answered in ctx.notes."""
        ctx.notes["backend"] = decision.backend
        if decision.backend == LEGACY:
            logits = self._batchers[LEGACY].submit(tensor, ctx.request_id, admission)
            if decision.shadow:
                self._shadow.offer(tensor, logits, ctx.request_id)
            return logits
        try:
            return self._triton(tensor, ctx, admission)
        except BackendError as e:
            if not decision.fallback:
                raise
            metrics.FALLBACKS.labels("circuit_open" if isinstance(e, CircuitOpen) else e.code).inc()
            ctx.notes["backend"] = LEGACY
            ctx.notes["fallback"] = e.code
            return self._batchers[LEGACY].submit(tensor, ctx.request_id)

    def readiness(self) -> tuple[bool, dict[str, Readiness]]:
        """Ready when the backends this mode answers with can answer (legacy covers Triton with fallback)."""
        mode = self.mode
        states = {}
        if mode in MODES_USING_LEGACY or self._guard.fallback:
            self._legacy().start()
            states[LEGACY] = self._legacy().ready()
        if mode in (Mode.TRITON, Mode.CANARY, Mode.SHADOW):
            states[TRITON] = self._batchers[TRITON].backend.ready()
        if mode is Mode.TRITON:
            ready = states[TRITON].ready or (self._guard.fallback and states[LEGACY].ready)
        else:  # legacy answers everything, or is the fallback of the canary share
            ready = states[LEGACY].ready
        return ready, states

    def close(self) -> None:
        self._shadow.close()
        for batcher in self._batchers.values():
            batcher.close()
            batcher.backend.close()

    def _triton(self, tensor: npt.NDArray[np.float32], ctx: RequestContext,
                admission: Admission | None) -> npt.NDArray[np.float32]:
        if not self.breaker.allow():
            self._watch_error_rate(ok=False)  # refused is failed, for the share of clients it hits
            raise CircuitOpen(f"Triton is failing: its circuit is open; next probe in "
                              f"{self.breaker.retry_in_s():.0f} s")
        try:
            logits = self._batchers[TRITON].submit(tensor, ctx.request_id, admission)
        except BackendError:
            self.breaker.record_failure()
            self._watch_error_rate(ok=False)
            raise
        self.breaker.record_success()
        self._watch_error_rate(ok=True)
        return logits

    def _watch_error_rate(self, *, ok: bool) -> None:
        if not self._guard.auto_rollback:
            return
        state = self.flag.current()
        if state.mode is not Mode.CANARY or state.canary_percent == 0:
            return
        failures, calls = self._errors.record(ok)
        if calls < self._guard.rollback_min_requests or failures / calls < self._guard.rollback_error_rate:
            return
        reason = (f"automatic rollback: Triton failed {failures} of the last {calls} canary requests in "
                  f"{self._guard.rollback_window_s:.0f} s ({failures / calls:.0%} >= "
                  f"{self._guard.rollback_error_rate:.0%}); canary share {state.canary_percent}% -> 0%")
        self._errors.clear()
        log.error("%s", reason)
        metrics.ROLLBACKS.inc()
        try:
            self.flag.write({"canary_percent": 0, "reason": reason}, updated_by="auto-rollback")
        except FlagNotWritable as e:  # a read-only (ConfigMap) flag: each worker rolls itself back
            log.error("%s; rolling back this worker only", e.message)
            self.flag.override({"canary_percent": 0, "reason": reason}, updated_by="auto-rollback")

    def _legacy(self) -> Backend:
        return self._batchers[LEGACY].backend


def describe(state: TrafficState, router: Router) -> dict[str, object]:
    """The read-only view of GET /traffic."""
    return {**state.to_json(), "flag_file": str(router.flag.path) if router.flag.path else None,
            "flag_file_error": router.flag.error, "fallback": router.fallback,
            "circuit": {TRITON: router.breaker.state}}
