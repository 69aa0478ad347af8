"""Which backend answers a request: the traffic mode in force (legacy, triton, shadow, canary), with guardrails.

In triton and canary modes a failed Triton call is answered by legacy when fallback is on, a circuit breaker keeps
calls away from a failing Triton, and the automatic rollback may drop the canary share to 0 (docs/traffic.md).
Router.infer says what happened: the ranked answer, the backend that answered, and why, if it fell back.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from app import metrics
from app.backends.base import Backend, Readiness
from app.batching import Batcher
from app.breaker import CircuitBreaker
from app.errors import BackendError, CircuitOpen, ShimError
from app.images import Upload
from app.readiness import SharedCheck
from app.rollback import AutoRollback
from app.scores import Ranked
from app.settings import MODES_USING_LEGACY, Mode
from app.shadow import ShadowRunner
from app.traffic import TrafficFlag, TrafficState, bucket

log = logging.getLogger(__name__)
LEGACY, TRITON = "legacy", "triton"


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    routing_key: str  # who the client is, for sticky canary assignment


@dataclass(frozen=True)
class Decision:
    mode: Mode
    backend: str  # the backend asked first
    shadow: bool = False
    fallback: bool = False  # may legacy answer if Triton fails?


@dataclass(frozen=True)
class Routed:
    """What happened to one request: its ranked answer, who answered, and why legacy did when it fell back."""

    ranked: Ranked
    backend: str
    fallback_reason: str | None = None


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    mode: Mode
    backends: dict[str, Readiness]
    transport: str | None  # how this worker sends to Triton, when the mode uses it


def sends_to_triton(state: TrafficState) -> bool:
    """Does the traffic in force send any request to Triton? (Not legacy, nor a canary or shadow share of 0.)"""
    return {Mode.LEGACY: False, Mode.TRITON: True, Mode.CANARY: state.canary_percent > 0,
            Mode.SHADOW: state.shadow_percent > 0}[state.mode]


class Router:
    def __init__(self, *, flag: TrafficFlag, batchers: dict[str, Batcher], breaker: CircuitBreaker,
                 shadow: ShadowRunner, fallback: bool, timeout_s: float, rollback: AutoRollback | None = None,
                 triton_check: SharedCheck | None = None,
                 turn: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.flag = flag
        self._turn = turn
        self.breaker = breaker
        self.fallback = fallback
        self._batchers = batchers
        self._shadow = shadow
        self._timeout_s = timeout_s  # the longest a request waits for its backend (queue + call)
        self._rollback = rollback
        self._triton_check = triton_check or SharedCheck(batchers[TRITON].backend.ready, deadline_s=timeout_s)
        self._circuit_shown: int | None = None
        self._circuit_lock = threading.Lock()
        breaker.on_change = self._show_circuit
        flag.on_change = self._show_circuit  # a switch away from Triton (or back) changes what the gauge says
        self._show_circuit()

    @property
    def mode(self) -> Mode:
        return self.flag.current().mode

    def _show_circuit(self, state: TrafficState | None = None) -> None:
        """shim_circuit_open: 1 while the breaker keeps requests of the traffic in force away from Triton; 0 when
        that traffic sends none there (legacy, a share of 0 after a rollback)."""
        shown = int(self.breaker.state != CircuitBreaker.CLOSED and sends_to_triton(state or self.flag.current()))
        if shown != self._circuit_shown:
            with self._circuit_lock:
                self._circuit_shown = shown
                metrics.CIRCUIT_OPEN.labels(TRITON).set(shown)

    def decide(self, ctx: RequestContext) -> Decision:
        state = self.flag.current()
        if state.mode is Mode.LEGACY:
            decision = Decision(state.mode, LEGACY)
        elif state.mode is Mode.TRITON:
            decision = Decision(state.mode, TRITON, fallback=self.fallback)
        elif state.mode is Mode.SHADOW:
            decision = Decision(state.mode, LEGACY, shadow=random.random() * 100 < state.shadow_percent)
        else:
            to_triton = bucket(ctx.routing_key) < state.canary_percent
            decision = Decision(state.mode, TRITON if to_triton else LEGACY, fallback=self.fallback)
        if decision.backend == LEGACY or decision.fallback:
            self._legacy().start()  # a switch to a mode that needs it: load it now, once
        return decision

    def prepare(self, upload: Upload, decision: Decision) -> Any:
        """In the request's own thread: what the backend asked first makes of the upload (app/backends/base.py)."""
        return self._batchers[decision.backend].backend.prepare(upload)

    def infer(self, upload: Upload, item: Any, ctx: RequestContext, decision: Decision) -> Routed:
        """The decided backend's answer (`item`: what it prepared), or legacy's when Triton fails (fallback)."""
        if decision.backend == LEGACY:
            ranked = self._batchers[LEGACY].submit(item, ctx.request_id, timeout_s=self._timeout_s)
            if decision.shadow:
                self._shadow.offer(upload, ranked.outputs, ctx.request_id)
            return Routed(ranked, LEGACY)
        try:
            return Routed(self._triton(item, ctx, decision), TRITON)
        except BackendError as e:
            if not decision.fallback:
                raise
            reason = "circuit_open" if isinstance(e, CircuitOpen) else e.code
            metrics.FALLBACKS.labels(reason).inc()
            with self._turn():  # while Triton is down every pending request decodes here: in turn, bounded
                legacy_item = self._legacy().prepare(upload)  # raises the contract's 400 / 413, legacy's
            ranked = self._batchers[LEGACY].submit(legacy_item, ctx.request_id, timeout_s=self._timeout_s)
            return Routed(ranked, LEGACY, fallback_reason=reason)

    def readiness(self) -> ReadinessReport:
        """Ready when the backends that answer this mode's clients can answer (_ready); Triton found ready
        half-opens an open circuit, so that the next request probes it."""
        state = self.flag.current()
        states: dict[str, Readiness] = {}
        if state.mode in MODES_USING_LEGACY or self.fallback:
            self._legacy().start()
            states[LEGACY] = self._legacy().ready()
        transport = None
        if state.mode is not Mode.LEGACY:
            states[TRITON] = self._triton_readiness()
            transport = getattr(self._batchers[TRITON].backend, "transport", None)
        return ReadinessReport(self._ready(state, states), state.mode, states, transport)

    def close(self) -> None:
        self.breaker.close()
        self._shadow.close()
        for batcher in self._batchers.values():
            batcher.close()
            batcher.backend.close()

    def _ready(self, state: TrafficState, states: dict[str, Readiness]) -> bool:
        legacy = states[LEGACY].ready if LEGACY in states else False
        triton = states[TRITON].ready if TRITON in states else False
        if state.mode is Mode.TRITON:
            return triton or (self.fallback and legacy)
        if state.mode is Mode.CANARY:
            return legacy and (triton or self.fallback or state.canary_percent == 0)
        return legacy  # legacy, shadow

    def _triton_readiness(self) -> Readiness:
        """Triton's readiness from the worker's shared check: this thread's own, or the latest one's."""
        checked = self._triton_check()
        if checked.fresh and checked.readiness.ready:
            self.breaker.probe_now()  # Triton answers again: an open circuit lets the next request probe it
        return checked.readiness

    def _triton(self, item: Any, ctx: RequestContext, decision: Decision) -> Ranked:
        if not self.breaker.allow():
            metrics.BACKEND_ERRORS.labels(TRITON, "circuit_open").inc()
            self._record_triton(ok=False, decision=decision)  # refused is failed, for the clients it hits
            raise CircuitOpen(f"Triton is failing: its circuit is open; next probe in "
                              f"{self.breaker.retry_in_s():.0f} s", backend=TRITON)
        try:
            ranked = self._batchers[TRITON].submit(item, ctx.request_id, timeout_s=self._timeout_s)
        except BackendError:
            self.breaker.record_failure()
            self._record_triton(ok=False, decision=decision)
            raise
        except ShimError:  # Triton answered: the upload is at fault (nor Triton nor the shim could read it)
            self.breaker.record_success()
            raise
        except BaseException:  # anything else too: a half-open probe must never be left without an outcome
            self.breaker.record_failure()
            self._record_triton(ok=False, decision=decision)
            raise
        self.breaker.record_success()
        self._record_triton(ok=True, decision=decision)
        return ranked

    def _record_triton(self, *, ok: bool, decision: Decision) -> None:
        if self._rollback is not None and decision.mode is Mode.CANARY:
            self._rollback.record(ok=ok)

    def _legacy(self) -> Backend:
        return self._batchers[LEGACY].backend


def describe(state: TrafficState, router: Router) -> dict[str, object]:
    """The read-only view of GET /traffic."""
    return {**state.to_json(), "flag_file": str(router.flag.path) if router.flag.path else None,
            "flag_file_error": router.flag.error, "fallback": router.fallback,
            "circuit": {TRITON: router.breaker.state}}
