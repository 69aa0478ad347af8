"""The shim's Prometheus metrics: a leaf module every other module may import.

Under gunicorn, app/gunicorn_conf.py points PROMETHEUS_MULTIPROC_DIR at a fresh folder before any worker
starts, so each worker writes its values there and /metrics adds them up across workers.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as _multiprocess
from prometheus_client.registry import REGISTRY

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REQUESTS = Counter(
    "shim_requests", "POST /predict requests answered, by the backend that answered, mode and HTTP status",
    ["backend", "mode", "status"])
REQUEST_SECONDS = Histogram(
    "shim_request_duration_seconds", "POST /predict latency inside the shim, by the backend that answered",
    ["backend"], buckets=LATENCY_BUCKETS)
STAGE_SECONDS = Histogram(
    "shim_stage_duration_seconds",
    "Time per request stage: decode, preprocess, queue (waiting in the batcher), infer (backend round trip, "
    "per batch), postprocess (scores and top k, per batch)", ["stage", "backend"], buckets=LATENCY_BUCKETS)
CPU_SECONDS = Counter(
    "shim_cpu_seconds", "CPU time of the shim's own threads for POST /predict, by part: request (a request "
    "thread from the app's first line to its answer, decode and preprocess included), decode, preprocess (its "
    "stages), send (building, sending and reading one backend call, by a batch sender), postprocess (scores "
    "and top k of a batch's rows, by its sender); what a worker spends beyond request, send and postprocess is "
    "gunicorn's (HTTP parsing, socket writes, its thread pool)", ["part", "backend"])
CPU_PARTS = ("request", "decode", "preprocess", "postprocess", "send")
BATCH_SIZE = Histogram(
    "shim_batch_size", "Images per backend call made by the shim's batcher", ["backend"],
    buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64))
BACKEND_ERRORS = Counter(
    "shim_backend_errors", "Requests a backend did not answer, by backend and code: backend_unavailable, "
    "backend_timeout (sent, no answer in time), backend_error, queue_timeout (timed out in the shim's own batch "
    "queue, never sent), circuit_open (refused while the circuit breaker is open)", ["backend", "code"])
CAPTURED = Counter(
    "shim_captured_uploads", "Accepted uploads offered to SHIM_CAPTURE_DIR, by result: kept, skipped (over the rate), "
    "error", ["result"])
REJECTED = Counter(
    "shim_rejected_requests", "POST /predict requests refused before any work, by reason (overloaded: the "
    "worker held SHIM_MAX_PENDING requests)", ["reason"])
FALLBACKS = Counter(
    "shim_fallbacks", "Requests answered by legacy because Triton could not answer, by reason", ["reason"])
ROLLBACKS = Counter(
    "shim_auto_rollbacks", "Times the canary share was dropped to 0 because Triton's error rate passed the threshold")
SHADOW_COMPARISONS = Counter(
    "shim_shadow_comparisons", "Shadow requests by outcome: match, mismatch, error, skipped", ["result"])
SHADOW_SCORE_DIFF = Histogram(
    "shim_shadow_max_abs_score_diff", "Largest score difference between legacy and Triton per shadow request",
    buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0))
TRAFFIC_MODE = Gauge(
    "shim_traffic_mode", "1 for the traffic mode in force, by mode and where it came from",
    ["mode", "source"], multiprocess_mode="liveall")
CANARY_PERCENT = Gauge(
    "shim_canary_percent", "Share of clients routed to Triton in canary mode", multiprocess_mode="liveall")
CIRCUIT_OPEN = Gauge(
    "shim_circuit_open", "1 while the circuit breaker keeps requests of the traffic in force away from the "
    "backend; 0 when it is closed or when that traffic sends none there (legacy mode, a share of 0)",
    ["backend"], multiprocess_mode="liveall")
ENCODED_CPU_PATH = Counter(
    "shim_encoded_cpu_path", "Uploads that the encoded transport decoded in the shim instead of forwarding them to "
    "Triton, by reason: format (not a JPEG), jpeg_mode (CMYK, YCCK), limits (over the pixel limits), unreadable "
    "(the shim answers 400), incomplete (a JPEG cut short, with no EOI or no scan: the shim answers as the legacy "
    "app does), decoder_refused (Triton's decoder refused it: the shim answered as the legacy app does); client "
    "uploads all, never Triton's failures", ["reason"])
TRANSPORT = Gauge(
    "shim_transport", "1 for the transport a worker sends to Triton with (SHIM_TRANSPORT)",
    ["transport"], multiprocess_mode="liveall")
PROXY_RESPONSES = Counter(
    "shim_proxy_responses", "Answers of the nginx in front of the shim (deploy/nginx), from its access log "
    "(SHIM_PROXY_LOG_ADDRESS): by path (/predict, /healthz, /readyz, other), HTTP status and, when nginx "
    "answered itself, its reason (empty: the shim's own answer, passed on)", ["path", "status", "reason"])
INFLIGHT = Gauge(
    "shim_inflight_requests", "POST /predict requests being handled now", multiprocess_mode="livesum")


TRANSPORTS = ("fp32", "uint8", "encoded")  # app/backends/triton: SHIM_TRANSPORT
FALLBACK_REASONS = ("backend_unavailable", "backend_timeout", "backend_error", "circuit_open")
SHADOW_RESULTS = ("match", "mismatch", "error", "skipped")
ENCODED_REASONS = ("format", "jpeg_mode", "limits", "unreadable", "incomplete", "decoder_refused")  # app/sniff.py
BACKEND_ERROR_CODES = ("backend_unavailable", "backend_timeout", "backend_error", "queue_timeout", "circuit_open")
# Why nginx answered a request itself (deploy/nginx/nginx.conf.template, map $shim_refusal).
PROXY_REASONS = ("client_limit", "overloaded", "too_large", "invalid_body", "bad_request", "client_timeout",
                 "client_closed", "backend_unavailable", "backend_timeout", "proxy_error", "not_found")
PROXY_PATHS = ("/predict", "/healthz", "/readyz")  # every other path counts as "other"


def initialize(backends: tuple[str, ...] = ("legacy", "triton")) -> None:
    """Create every known label set at zero, so that dashboards and alerts see a series from the start."""
    for reason in FALLBACK_REASONS:
        FALLBACKS.labels(reason)
    REJECTED.labels("overloaded")
    for result in ("kept", "skipped", "error"):
        CAPTURED.labels(result)
    for result in SHADOW_RESULTS:
        SHADOW_COMPARISONS.labels(result)
    for reason in ENCODED_REASONS:
        ENCODED_CPU_PATH.labels(reason)
    for backend in backends:
        for part in CPU_PARTS:
            CPU_SECONDS.labels(part, backend)
        CIRCUIT_OPEN.labels(backend).set(0)
        for code in BACKEND_ERROR_CODES:
            BACKEND_ERRORS.labels(backend, code)


def publish_transport(transport: str) -> None:
    for name in TRANSPORTS:
        TRANSPORT.labels(name).set(1 if name == transport else 0)


def exposition() -> bytes:
    """The text /metrics serves: every worker's values when running under gunicorn."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        _multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def mark_worker_dead(pid: int) -> None:
    """gunicorn's child_exit hook: drop a dead worker's live gauges."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
