"""app/openapi.json against the app itself, in-process: its routes, its error codes, the README's contract
table, and every answer the app gives (with fakes at the Backend seam, so the 5xx and 409 that no request
can provoke in a live shim are answered too) checked against the document's status, headers and schema.

tests/integration/test_openapi.py runs schemathesis against a live shim under gunicorn and Triton.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from app import contract
from app.api import OPENAPI
from app.errors import ShimError
from app.settings import Mode
from tests.support import ROOT
from tests.unit.test_api import App, make_app, post_multipart

DOC: dict[str, Any] = json.loads(OPENAPI.read_text())
URI = "urn:flask-triton-shim:openapi"
REGISTRY: Registry[Any] = Registry().with_resource(URI, Resource.from_contents(DOC, default_specification=DRAFT202012))
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
ANY_PATH = {404: "NotFound", 405: "MethodNotAllowed"}  # answers of paths and methods the document does not list


def escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def resolve(node: Any, pointer: str) -> tuple[Any, str]:
    """The node a $ref chain ends at, and its JSON pointer in the document."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), f"{pointer}: only local references, not {ref}"
        pointer = ref[1:]
        node = DOC
        for part in pointer.split("/")[1:]:
            node = node[part.replace("~1", "/").replace("~0", "~")]
    return node, pointer


def validate(instance: Any, pointer: str) -> None:
    Draft202012Validator({"$ref": f"{URI}#{pointer}"}, registry=REGISTRY).validate(instance)


def responses() -> Iterator[tuple[int, Any, str]]:
    """(status, response object, its pointer) of every operation and of components/responses."""
    for path, item in DOC["paths"].items():
        for method, operation in item.items():
            if method in METHODS:
                for status, response in operation["responses"].items():
                    here = f"/paths/{escape(path)}/{method}/responses/{status}"
                    yield (int(status), *resolve(response, here))
    for name, response in DOC["components"]["responses"].items():
        status = next((s for s, n in ANY_PATH.items() if n == name), None)
        if status is not None:
            yield status, response, f"/components/responses/{name}"


def error_codes(response: dict[str, Any]) -> set[str]:
    """The `error` codes a response's body may carry (its own enum or const, else the Error schema's); none
    when the body is not an error (the 503 of /readyz)."""
    schema, _ = resolve(response["content"]["application/json"]["schema"], "")
    error = schema.get("properties", {}).get("error")
    if error is None and "allOf" in schema:
        error = next(resolve(part, "")[0]["properties"]["error"] for part in schema["allOf"])
    if error is None:
        return set()
    return {error["const"]} if "const" in error else set(error["enum"])


def documented_errors() -> set[tuple[str, int]]:
    return {(code, status) for status, response, _ in responses() if status >= 400 for code in error_codes(response)}


def any_path(status: int) -> tuple[Any, str]:
    name = ANY_PATH[status]
    return resolve(DOC["components"]["responses"][name], f"/components/responses/{name}")


def app_errors() -> set[tuple[str, int]]:
    """Every (code, status) the app answers with: its exceptions and Flask's own errors in the contract's words."""
    found = set()
    pending: list[type[ShimError]] = [ShimError]
    while pending:
        cls = pending.pop()
        found.add((cls.code, cls.status))
        pending.extend(cls.__subclasses__())
    return found | {(code, status) for status, (code, _) in contract.HTTP_ERRORS.items()}


def test_the_document_is_valid_openapi_3_1() -> None:
    assert DOC["openapi"].startswith("3.1.")
    schemathesis.openapi.from_path(OPENAPI).validate()  # the OpenAPI 3.1 meta-schema (structure)

    def walk(node: Any, pointer: str) -> Iterator[tuple[Any, str]]:
        if isinstance(node, dict):
            yield node, pointer
            for key, value in node.items():
                yield from walk(value, f"{pointer}/{escape(key)}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, f"{pointer}/{index}")

    schemas = [(schema, f"/components/schemas/{name}") for name, schema in DOC["components"]["schemas"].items()]
    schemas += [(node["schema"], f"{pointer}/schema") for node, pointer in walk(DOC, "") if "schema" in node]
    meta = Draft202012Validator(Draft202012Validator.META_SCHEMA)
    for schema, pointer in schemas:  # each Schema Object against JSON Schema 2020-12, OpenAPI 3.1's dialect
        errors = list(meta.iter_errors(schema))
        assert not errors, f"{pointer}: {errors[0].message}"
    for node, pointer in walk(DOC, ""):
        if "$ref" in node:
            resolve(node, pointer)  # every reference points at something


def test_its_paths_are_exactly_the_apps_routes(app: App) -> None:
    routes = {(re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule), method)
              for rule in app.flask.url_map.iter_rules() if rule.endpoint != "static"
              for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}}
    documented = {(path, method.upper()) for path, item in DOC["paths"].items() for method in item if method in METHODS}
    assert documented == routes


def test_the_app_serves_the_file(app: App) -> None:
    answer = app.client.get("/openapi.json")
    assert answer.status_code == 200 and answer.mimetype == "application/json"
    assert answer.data == OPENAPI.read_bytes()


def test_every_error_code_of_the_app_is_documented_with_its_status_and_no_other() -> None:
    assert documented_errors() == app_errors()
    error, _ = resolve(DOC["components"]["schemas"]["Error"], "")
    assert set(error["properties"]["error"]["enum"]) == {code for code, _ in app_errors()}


def test_every_answer_of_the_readme_contract_table_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The /predict contract", 1)[1].split("\n## ", 1)[0]
    rows = {(code, int(status)) for status, code in re.findall(r"^\| (\d{3}) \| `(\w+)` \|", section, re.MULTILINE)}
    assert len(rows) >= 10, "the README's contract table was not found"
    predict = DOC["paths"]["/predict"]["post"]["responses"]
    for code, status in rows:
        if status in ANY_PATH:
            response, _ = any_path(status)
        else:
            assert str(status) in predict, f"README: {status} {code}, not documented for POST /predict"
            response, _ = resolve(predict[str(status)], "")
        assert code in error_codes(response), f"README: {status} {code}"
    assert "200" in predict


def assert_documented(method: str, path: str, answer: Any) -> None:
    """The answer's status, media type, headers and body are the ones the document gives for it."""
    operation = DOC["paths"].get(path, {}).get(method.lower())
    status = answer.status_code
    if operation is not None:
        assert str(status) in operation["responses"], f"{method} {path}: {status} is not documented"
        response, pointer = resolve(operation["responses"][str(status)],
                                    f"/paths/{escape(path)}/{method.lower()}/responses/{status}")
    else:
        assert status in ANY_PATH, f"{method} {path}: {status}"
        response, pointer = any_path(status)
    assert answer.mimetype in response["content"], (method, path, status, answer.mimetype)
    if answer.mimetype == "application/json":
        validate(answer.json, f"{pointer}/content/{escape(answer.mimetype)}/schema")
    for name, header in response.get("headers", {}).items():
        header, header_pointer = resolve(header, f"{pointer}/headers/{name}")
        value = answer.headers.get(name)
        if value is None:
            assert not header.get("required"), f"{method} {path} {status}: no {name} header"
            continue
        validate(int(value) if header["schema"].get("type") == "integer" else value, f"{header_pointer}/schema")


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    made = make_app(tmp_path)
    yield made
    made.flask.extensions["shim"].close()


Call = Callable[[App], Any]
ANSWERS: list[tuple[str, str, str, Call, int, dict[str, Any]]] = [
    # (name, method, path, call, expected status, settings)
    ("photo", "POST", "/predict", lambda a: a.predict(headers={"X-Request-ID": "unit-1"}), 200, {}),
    ("photo with fallback", "POST", "/predict", lambda a: down(a).predict(), 200, {"fallback": True}),
    ("no image", "POST", "/predict", lambda a: a.client.post("/predict", json={"image": "x"}), 400, {}),
    ("empty image", "POST", "/predict", lambda a: a.predict(b""), 400, {}),
    ("not an image", "POST", "/predict", lambda a: a.predict(b"GIF89a and then nothing"), 400, {}),
    ("1001 form parts", "POST", "/predict",
     lambda a: post_multipart(a.client, {f"f{i}": "x" for i in range(1001)}), 413, {}),
    ("Triton down", "POST", "/predict", lambda a: down(a).predict(), 503, {}),
    ("Triton fails", "POST", "/predict", lambda a: broken(a).predict(), 502, {}),
    ("Triton hangs", "POST", "/predict", lambda a: hung(a), 504, {"triton_timeout_s": 0.3}),
    ("worker full", "POST", "/predict", lambda a: overloaded(a), 503, {"max_pending": 1}),
    ("GET /predict", "GET", "/predict", lambda a: a.client.get("/predict"), 405, {}),
    ("another path", "GET", "/nowhere", lambda a: a.client.get("/nowhere"), 404, {}),
    ("healthz", "GET", "/healthz", lambda a: a.client.get("/healthz"), 200, {}),
    ("ready", "GET", "/readyz", lambda a: a.client.get("/readyz"), 200, {"mode": Mode.CANARY, "canary_percent": 5}),
    ("not ready", "GET", "/readyz", lambda a: down(a).client.get("/readyz"), 503, {}),
    ("legacy mode", "GET", "/readyz", lambda a: a.client.get("/readyz"), 200, {"mode": Mode.LEGACY}),
    ("metrics", "GET", "/metrics", lambda a: a.client.get("/metrics"), 200, {}),
    ("traffic", "GET", "/traffic", lambda a: a.client.get("/traffic"), 200, {}),
    ("openapi", "GET", "/openapi.json", lambda a: a.client.get("/openapi.json"), 200, {}),
    ("PUT /traffic", "PUT", "/traffic", lambda a: a.client.put("/traffic", json={"mode": "legacy"}), 405, {}),
]


def down(app: App) -> App:
    app.triton.down = True
    return app


def broken(app: App) -> App:
    app.triton.broken = True
    return app


def hung(app: App) -> Any:
    app.triton.hang.set()
    try:
        return app.predict()
    finally:
        app.triton.hang.clear()


def overloaded(app: App) -> Any:
    """One request holds the worker's only place (Triton hangs); the next one is refused at once."""
    app.triton.hang.set()
    first = threading.Thread(target=app.predict)
    first.start()
    try:
        admission = app.flask.extensions["shim"].admission
        for _ in range(500):
            if admission.pending:
                break
            threading.Event().wait(0.01)
        return app.predict()
    finally:
        app.triton.hang.clear()
        first.join(timeout=30)


@pytest.mark.parametrize(("name", "method", "path", "call", "status", "settings"), ANSWERS, ids=[a[0] for a in ANSWERS])
def test_every_answer_of_the_app_is_the_documented_one(tmp_path: Path, name: str, method: str, path: str, call: Call,
                                                       status: int, settings: dict[str, Any]) -> None:
    app = make_app(tmp_path, **settings)
    try:
        answer = call(app)
        assert answer.status_code == status, answer.get_data(as_text=True)
        assert_documented(method, path, answer)
    finally:
        app.flask.extensions["shim"].close()
