"""Shadow traffic: the client gets the legacy answer; Triton's answer to the same upload is compared.

Off the request path, at most `max_inflight` per worker; a request that finds them all busy (or the circuit open)
is skipped and counted, so a slow Triton never slows a client. A few mismatches per minute are logged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app import metrics
from app.batching import Batcher
from app.breaker import CircuitBreaker
from app.errors import ShimError
from app.images import Upload
from app.scores import Scores, best, softmax

log = logging.getLogger(__name__)
MAX_INFLIGHT = 4  # shadow calls per worker at once; more are skipped, never queued
# The largest score difference that is a match: twice the largest measured after Triton's decode step (CPU: 0.0028
# over 93 JPEGs, bench/device_check.sh --dry-run; tensor transports ~1e-6). A GPU run measures its own (docs/gpu.md).
TOLERANCE = 0.006
LOGS_PER_MINUTE = 10  # mismatch samples logged per worker per minute


@dataclass(frozen=True)
class Comparison:
    same_top1: bool
    topk_overlap: float  # share of legacy's top-k that Triton's top-k also holds
    max_abs_diff: float  # largest difference of any class score
    matched: bool


def compare(legacy: npt.NDArray[np.float32], candidate: npt.NDArray[np.float32], *, k: int,
            tolerance: float, scores: Scores = softmax) -> Comparison:
    p, q = scores(legacy), scores(candidate)
    top_p, top_q = best(p, k), best(q, k)
    same_top1 = top_p[0] == top_q[0]
    overlap = len(set(top_p) & set(top_q)) / k
    diff = float(np.abs(p - q).max())
    return Comparison(same_top1, overlap, diff, same_top1 and overlap == 1.0 and diff <= tolerance)


class ShadowRunner:
    def __init__(self, batcher: Batcher, breaker: CircuitBreaker, *, top_k: int, max_inflight: int = MAX_INFLIGHT,
                 timeout_s: float, tolerance: float = TOLERANCE, logs_per_minute: int = LOGS_PER_MINUTE,
                 scores: Scores = softmax) -> None:
        self._batcher = batcher
        self._scores = scores
        self._breaker = breaker
        self._max_inflight = max_inflight
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._timeout_s = timeout_s
        self._tolerance = tolerance
        self._k = top_k
        self._logs_per_minute = logs_per_minute
        self._logged: list[float] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def offer(self, upload: Upload, legacy_logits: npt.NDArray[np.float32], request_id: str) -> None:
        """Shadow this request if a slot is free and the circuit allows; never blocks."""
        if not self._slots.acquire(blocking=False):
            metrics.SHADOW_COMPARISONS.labels("skipped").inc()
            return
        if not self._breaker.allow():
            self._slots.release()
            metrics.SHADOW_COMPARISONS.labels("skipped").inc()
            return
        self._executor().submit(self._run, upload, legacy_logits, request_id)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:  # threads do not survive a fork: a pool per process
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self._max_inflight, thread_name_prefix="shadow")
                self._pid = os.getpid()
            return self._pool

    def _run(self, upload: Upload, legacy_logits: npt.NDArray[np.float32], request_id: str) -> None:
        try:  # prepared here, off the request path: the upload sent as Triton's backend would send it
            item = self._batcher.backend.prepare(upload)
            candidate = self._batcher.submit(item, f"{request_id}-shadow", timeout_s=self._timeout_s).outputs
        except Exception as e:  # the shadow thread's outermost frame: every probe records an outcome
            self._breaker.record_failure()
            metrics.SHADOW_COMPARISONS.labels("error").inc()
            if isinstance(e, ShimError):
                log.debug("shadow request failed: %s", e.message)
            else:
                log.exception("shadow request failed unexpectedly")
            return
        finally:
            self._slots.release()
        self._breaker.record_success()
        result = compare(legacy_logits, candidate, k=self._k, tolerance=self._tolerance, scores=self._scores)
        metrics.SHADOW_SCORE_DIFF.observe(result.max_abs_diff)
        metrics.SHADOW_COMPARISONS.labels("match" if result.matched else "mismatch").inc()
        if not result.matched and self._may_log():
            log.warning("shadow mismatch: top-1 %s, top-%d overlap %.0f%%, max score difference %.2g",
                        "same" if result.same_top1 else "differs", self._k, result.topk_overlap * 100,
                        result.max_abs_diff, extra={
                            "request_id": request_id,
                            "legacy_top": best(legacy_logits, self._k),
                            "triton_top": best(candidate, self._k)})

    def _may_log(self) -> bool:
        now = time.monotonic()
        with self._lock:
            self._logged = [t for t in self._logged if now - t < 60]
            if len(self._logged) >= self._logs_per_minute:
                return False
            self._logged.append(now)
            return True
