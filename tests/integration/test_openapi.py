"""app/openapi.json holds true of the live shim: schemathesis drives every operation it documents.

The shim runs under real gunicorn against the session's real Triton. For each operation schemathesis
sends the document's examples, its coverage cases (every boundary, every missing or mistyped field,
undeclared methods) and a bounded number of generated requests, good and bad. Every answer must be
documented (status, content type, headers, body), none may be a 5xx, and generated bad input must get
one of the contract's 4xx. Every operation is read-only but POST /predict: nothing sent over HTTP changes the
traffic (the shim-traffic command does).

What no request from outside can make happen (502, 503, 504) is checked in-process against the
same document in tests/unit/test_openapi.py.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis

from app.api import OPENAPI
from devstack.launch import ServedApp
from tests.support import encode, photo

pytestmark = pytest.mark.triton
# What generated bad input may get: the contract's refusals. Not 5xx (schemathesis's default allows it).
CONTRACT_4XX = [400, 413]
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "response_headers_conformance", "negative_data_rejection", "missing_required_header", "unsupported_method"]
CONFIG = schemathesis.Config.from_dict({
    "seed": 13,  # the same cases on every run; change it to explore others
    "request-timeout": 60,
    # positive and negative: up to 25 generated requests per operation and mode, after examples and coverage
    "generation": {"mode": "all", "max-examples": 25, "database": "none"},
    "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS},
               "negative_data_rejection": {"enabled": True, "expected-statuses": CONTRACT_4XX}},
})
SCHEMA = schemathesis.openapi.from_path(OPENAPI, config=CONFIG)


@pytest.fixture(scope="session")  # session-scoped as the one it names: schemathesis reuses it across inputs
def shim(shim_triton: ServedApp) -> ServedApp:
    """The session's shim in triton mode, as `make run` starts it."""
    return shim_triton


@SCHEMA.parametrize()
def test_every_operation_answers_as_documented(case: schemathesis.Case, shim: ServedApp) -> None:
    case.call_and_validate(base_url=shim.url)


def test_a_photo_gets_the_documented_answer_from_triton(shim: ServedApp) -> None:
    """Generated uploads are mostly refused; a real photo must get the documented 200, with its headers."""
    case = SCHEMA["/predict"]["POST"].Case(body={"image": encode(photo(320, 240, seed=13), "JPEG")},
                                           headers={"X-Request-ID": "openapi-photo-1"})
    answer = case.call_and_validate(base_url=shim.url)
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == ["openapi-photo-1"] and answer.headers["x-shim-backend"] == ["triton"]


def test_an_upload_over_the_limit_gets_the_documented_413(shim: ServedApp) -> None:
    case = SCHEMA["/predict"]["POST"].Case(body={"image": b"\0" * (17 * 1024 * 1024)})
    assert case.call_and_validate(base_url=shim.url).status_code == 413


def test_the_served_document_is_the_file(shim: ServedApp) -> None:
    answer = requests.get(shim.url + "/openapi.json", timeout=10)
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "application/json"
    assert answer.content == OPENAPI.read_bytes()


def test_no_request_changed_the_traffic(shim: ServedApp) -> None:
    kept = requests.get(shim.url + "/traffic", timeout=10).json()
    assert (kept["mode"], kept["source"]) == ("triton", "env"), kept
    assert "Traceback" not in shim.log(), shim.log()


def test_a_method_not_allowed_names_the_allowed_ones(shim: ServedApp) -> None:
    answer = requests.get(shim.url + "/predict", timeout=10)
    assert answer.status_code == 405 and answer.json()["error"] == "method_not_allowed"
    assert answer.headers.get("Allow") == "OPTIONS, POST"  # Flask answers OPTIONS itself
