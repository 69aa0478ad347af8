"""The legacy /predict contract, in one place: a team whose legacy app answered in another shape changes this
module and nothing else (taken from examples/legacy_app.py; tests/integration/test_contract.py holds both to it).

    POST /predict   multipart/form-data, file field "image"
    200  {"model": "resnet50", "predictions": [{"label": "tabby", "class_id": 281, "score": 0.91}, ...]}
    4xx/5xx  {"error": "<code>", "message": "<what went wrong>"}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import BrokenBody, InvalidRequest, ShimError

IMAGE_FIELD = "image"

# Errors that Flask itself raises, in the contract's words.
HTTP_ERRORS: dict[int, tuple[str, str]] = {
    400: ("bad_request", "the request is not valid"),
    404: ("not_found", "no such endpoint: use POST /predict"),
    405: ("method_not_allowed", "method not allowed: use POST /predict"),
    413: ("too_large", "the upload is too large"),
}


@dataclass(frozen=True)
class Prediction:
    label: str
    class_id: int
    score: float


def prediction_body(model: str, predictions: Sequence[Prediction]) -> dict[str, Any]:
    return {
        "model": model,
        "predictions": [{"label": p.label, "class_id": p.class_id, "score": p.score} for p in predictions],
    }


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": code, "message": message}


def server_error_response(status: int, reason: str, detail: str) -> bytes:
    """A whole HTTP response, in the contract's shape, for what gunicorn answers itself: a request line or header
    it cannot parse (400, 414, 431), a broken chunked body, an app that failed outside Flask (500)."""
    error = ShimError()  # gunicorn's answer when the app itself failed
    if status < 500:  # the error tree's codes, which nginx gives for the same
        kind = BrokenBody if "chunk" in detail.lower() else InvalidRequest
        error = kind(f"the request could not be read: {reason.lower()}{f' ({detail})' if detail else ''}")
    body = json.dumps(error_body(error.code, error.message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body
