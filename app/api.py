"""HTTP edge: POST /predict (the legacy contract), /healthz, /readyz, /metrics, and error translation."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from app import bodies, contract, metrics
from app.errors import BackendError, MissingImage, ShimError
from app.logs import REQUEST_ID, new_request_id
from app.routing import RequestContext, describe
from app.uploads import image_from_form
from app.wiring import Shim

log = logging.getLogger(__name__)
bp = Blueprint("shim", __name__)

REQUEST_ID_HEADER = "X-Request-ID"
BACKEND_HEADER = "X-Shim-Backend"  # on answers: which backend answered
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPENAPI = Path(__file__).with_name("openapi.json")


def shim() -> Shim:
    instance: Shim = current_app.extensions["shim"]
    return instance


@bp.before_app_request
def _start() -> None:
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    g.request_id = offered if _VALID_REQUEST_ID.match(offered) else new_request_id()
    g.token = REQUEST_ID.set(g.request_id)
    g.started, g.cpu_started = time.perf_counter(), time.thread_time()
    bodies.guard(request.environ, current_app.config["MAX_CONTENT_LENGTH"])


@bp.after_app_request
def _finish(response: Response) -> Response:
    bodies.drain(request.environ, current_app.config["MAX_CONTENT_LENGTH"])
    response.headers[REQUEST_ID_HEADER] = g.get("request_id", "")
    if "backend" in g:  # errors too: which backend failed
        response.headers[BACKEND_HEADER] = g.backend
    if request.endpoint == "shim.predict" or request.path == "/predict":
        backend = g.get("backend", "none")
        now, cpu_now = time.perf_counter(), time.thread_time()
        elapsed = now - g.get("started", now)  # one figure: metric and log agree
        cpu = cpu_now - g.get("cpu_started", cpu_now)  # this thread's CPU, waits excluded
        metrics.REQUESTS.labels(backend, shim().router.mode.value, str(response.status_code)).inc()
        metrics.REQUEST_SECONDS.labels(backend).observe(elapsed)
        metrics.CPU_SECONDS.labels("request", backend).inc(cpu)
        extra = {"status": response.status_code, "backend": backend, "duration_ms": round(elapsed * 1000, 2)}
        if "fallback" in g:
            extra["fallback"] = g.fallback
        log.info("%s %s %d", request.method, request.path, response.status_code, extra=extra)
    return response


@bp.teardown_app_request
def _reset(_: BaseException | None) -> None:
    token = g.pop("token", None)
    if token is not None:
        REQUEST_ID.reset(token)


@bp.post("/predict")
def predict() -> Response:
    content_type = request.headers.get("Content-Type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise MissingImage()  # the contract's answer to a JSON or raw body; its bytes are never read
    admission = shim().admission
    with admission.admit(), admission.large(request.content_length):  # full: 503 at once; large: one of 2
        return _predict(content_type)


def _predict(content_type: str) -> Response:
    data = image_from_form(request.get_data(cache=False), content_type, contract.IMAGE_FIELD,
                           max_parts=current_app.config["MAX_FORM_PARTS"],
                           max_field_bytes=current_app.config["MAX_FORM_MEMORY_SIZE"])
    ctx = RequestContext(request_id=g.request_id,
                         routing_key=request.headers.get(shim().settings.canary_header) or request.remote_addr or "")
    metrics.INFLIGHT.inc()
    try:
        answer = shim().service.predict(data, ctx)
    except BackendError as e:
        g.backend = e.backend
        raise
    finally:
        metrics.INFLIGHT.dec()
    g.backend = answer.backend
    response = jsonify(contract.prediction_body(answer.model, answer.predictions))
    if answer.fallback_reason:
        g.fallback = answer.fallback_reason
    return response


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify(status="ok")


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    report = shim().router.readiness()
    body = {"ready": report.ready, "mode": report.mode.value,
            "backends": {name: {"ready": s.ready, "detail": s.detail, "age_s": s.age_s}
                         for name, s in report.backends.items()},
            "transport": report.transport}
    return jsonify(body), 200 if report.ready else 503


@bp.get("/traffic")
def traffic() -> Response:
    """Read-only: this worker's mode, where it came from, the circuit's state (shim-traffic changes it)."""
    router = shim().router
    state = router.flag.current()
    return jsonify(describe(state, router))


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3.1 description of every route (app/openapi.json), kept true by tests/integration."""
    return Response(OPENAPI.read_bytes(), mimetype="application/json")


@bp.get("/metrics")
def prometheus_metrics() -> Response:
    return Response(metrics.exposition(), mimetype="text/plain; version=0.0.4")


@bp.app_errorhandler(ShimError)
def _shim_error(e: ShimError) -> tuple[Response, int]:
    level = logging.WARNING if e.status >= 500 and not e.quiet else logging.INFO
    log.log(level, "%s: %s", e.code, e.message, extra={"status": e.status, "error": e.code})
    response = jsonify(contract.error_body(e.code, e.message))
    response.headers.update(e.headers())
    return response, e.status


@bp.app_errorhandler(HTTPException)
def _http_error(e: HTTPException) -> tuple[Response, int]:
    status = e.code or 500
    code, message = contract.HTTP_ERRORS.get(status, ("bad_request" if status < 500 else "internal_error",
                                                      e.description or e.name))
    if status == 413:
        message = _too_large_message()
    response = jsonify(contract.error_body(code, message))
    if isinstance(e, MethodNotAllowed) and e.valid_methods:
        response.headers["Allow"] = ", ".join(sorted(e.valid_methods))  # RFC 9110: a 405 names what is allowed
    return response, status


def _too_large_message() -> str:
    """Werkzeug says 413 for three limits alike: name the one this request crossed."""
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    if request.content_length is None:  # chunked: the body ran past the limit while it was read
        return f"the upload is too large: the body went past the limit of {limit:,} bytes"
    return (f"the form is too large: more than {current_app.config['MAX_FORM_PARTS']:,} form parts, or a "
            f"field that is not a file over {current_app.config['MAX_FORM_MEMORY_SIZE']:,} bytes")


@bp.app_errorhandler(Exception)
def _unexpected(e: Exception) -> tuple[Response, int]:
    log.exception("unhandled error while serving %s %s", request.method, request.path)
    return jsonify(contract.error_body("internal_error", "internal error")), 500


def register(app: Flask) -> None:
    app.register_blueprint(bp)
