"""HTTP edge: POST /predict (the legacy contract), /healthz, /readyz, /metrics, and error translation."""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from app import contract, metrics
from app.errors import Forbidden, InvalidRequest, MissingImage, ShimError, Unauthorized
from app.logs import REQUEST_ID
from app.routing import RequestContext, describe
from app.wiring import Shim

log = logging.getLogger(__name__)
bp = Blueprint("shim", __name__)

REQUEST_ID_HEADER = "X-Request-ID"
BACKEND_HEADER = "X-Shim-Backend"  # on answers: which backend answered; on requests: the QA override
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
DRAIN_LIMIT = 256 * 1024 * 1024  # read and drop refused uploads up to this size so the client sees the 413


def shim() -> Shim:
    instance: Shim = current_app.extensions["shim"]
    return instance


@bp.before_app_request
def _start() -> None:
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    g.request_id = offered if _VALID_REQUEST_ID.match(offered) else uuid.uuid4().hex
    g.token = REQUEST_ID.set(g.request_id)
    g.started = time.perf_counter()


@bp.after_app_request
def _finish(response: Response) -> Response:
    _drain_body()
    response.headers[REQUEST_ID_HEADER] = g.get("request_id", "")
    if request.endpoint == "shim.predict" or request.path == "/predict":
        backend = g.get("backend", "none")
        metrics.REQUESTS.labels(backend, shim().router.mode.value, str(response.status_code)).inc()
        metrics.REQUEST_SECONDS.labels(backend).observe(time.perf_counter() - g.get("started", time.perf_counter()))
        log.info("%s %s %d", request.method, request.path, response.status_code,
                 extra={"status": response.status_code, "backend": backend,
                        "duration_ms": round((time.perf_counter() - g.started) * 1000, 2)})
    return response


@bp.teardown_app_request
def _reset(_: BaseException | None) -> None:
    token = g.pop("token", None)
    if token is not None:
        REQUEST_ID.reset(token)


@bp.post("/predict")
def predict() -> Response:
    upload = request.files.get(contract.IMAGE_FIELD)
    if upload is None:
        raise MissingImage()
    settings = shim().settings
    forced = request.headers.get(BACKEND_HEADER) if settings.override_header else None
    ctx = RequestContext(request_id=g.request_id, routing_key=_routing_key(settings.canary_header),
                         forced_backend=forced)
    metrics.INFLIGHT.inc()
    try:
        answer = shim().service.predict(upload.read(), ctx)
    finally:
        metrics.INFLIGHT.dec()
        g.backend = ctx.notes.get("backend", "none")
    response = jsonify(contract.prediction_body(answer.model, answer.predictions))
    response.headers[BACKEND_HEADER] = answer.backend
    return response


def _routing_key(header: str) -> str:
    """The canary targeting key: the configured header, else the first forwarded client, else the peer."""
    forwarded = request.headers.get("X-Forwarded-For", "").split(",")[0].strip()
    return request.headers.get(header) or forwarded or request.remote_addr or ""


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify(status="ok")


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    ready, states = shim().router.readiness()
    body = {"ready": ready, "mode": shim().router.mode.value,
            "backends": {name: {"ready": s.ready, "detail": s.detail} for name, s in states.items()}}
    return jsonify(body), 200 if ready else 503


@bp.get("/traffic")
def traffic() -> Response:
    """Read-only: the mode in force in this worker, where it came from, the circuit's state."""
    router = shim().router
    return jsonify(describe(router.flag.current(), router))


@bp.put("/admin/traffic")
def change_traffic() -> Response:
    """Switch the mode (or canary/shadow share) for every worker: {"mode": "canary", "canary_percent": 10}."""
    _require_admin()
    changes = request.get_json(silent=True)
    if not isinstance(changes, dict):
        raise InvalidRequest("send a JSON object, e.g. {\"mode\": \"canary\", \"canary_percent\": 10}")
    router = shim().router
    state = router.flag.write(changes, updated_by="admin-api")
    log.warning("traffic changed through the admin API: %s", state.to_json(), extra={"client": request.remote_addr})
    return jsonify(describe(state, router))


def _require_admin() -> None:
    token = shim().settings.admin_token
    if not token:
        raise Forbidden("the admin API is off: set SHIM_ADMIN_TOKEN to enable it")
    scheme, _, offered = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not offered:
        raise Unauthorized()
    if not hmac.compare_digest(offered.encode(), token.encode()):
        raise Forbidden()


@bp.get("/metrics")
def prometheus_metrics() -> Response:
    return Response(metrics.exposition(), mimetype="text/plain; version=0.0.4")


@bp.app_errorhandler(ShimError)
def _shim_error(e: ShimError) -> tuple[Response, int]:
    level = logging.WARNING if e.status >= 500 else logging.INFO
    log.log(level, "%s: %s", e.code, e.message, extra={"status": e.status, "error": e.code})
    return jsonify(contract.error_body(e.code, e.message)), e.status


@bp.app_errorhandler(HTTPException)
def _http_error(e: HTTPException) -> tuple[Response, int]:
    status = e.code or 500
    code, message = contract.HTTP_ERRORS.get(status, ("http_error", e.description or e.name))
    if status == 413:
        message = f"the upload is too large: the limit is {current_app.config['MAX_CONTENT_LENGTH']:,} bytes"
    return jsonify(contract.error_body(code, message)), status


@bp.app_errorhandler(Exception)
def _unexpected(e: Exception) -> tuple[Response, int]:
    log.exception("unhandled error while serving %s %s", request.method, request.path)
    return jsonify(contract.error_body("internal_error", "internal error")), 500


def _drain_body() -> None:
    """Read what is left of the request body before answering.

    A body the app did not read (a 405, a 413, an error before the form was parsed) stays in the socket;
    gunicorn then closes a keep-alive connection that it announced open, and the client's next request
    on it fails. Reading it (bounded) keeps the connection usable and makes sure the client sees the answer.
    """
    stream: Any = request.environ.get("wsgi.input")
    remaining = DRAIN_LIMIT
    while stream is not None and remaining > 0:
        chunk = stream.read(min(remaining, 1 << 20))
        if not chunk:
            break
        remaining -= len(chunk)


def register(app: Flask) -> None:
    app.register_blueprint(bp)
