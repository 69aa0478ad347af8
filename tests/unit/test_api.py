"""The whole Flask app in-process, with fake backends at the seam, driven by Flask's test client.

What the legacy contract promises (shapes, codes, headers), the error mapping, the read-only traffic view and
readiness, without a server: tests/integration holds the same app under gunicorn against the real Triton.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import EnvironBuilder

from app import create_app
from app.settings import Mode, Settings
from tests.fakes import EchoBackend, with_traffic, write_model_repo
from tests.support import encode, photo
from tests.uploads import Upload, bad_uploads, malformed_uploads, valid_uploads

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

JPEG = encode(photo(320, 240, seed=5), "JPEG")


@dataclass
class App:
    flask: Flask
    client: FlaskClient
    triton: EchoBackend
    legacy: EchoBackend
    flag_file: Path

    def predict(self, data: bytes = JPEG, headers: dict[str, str] | None = None) -> Any:
        return post_multipart(self.client, {"image": (io.BytesIO(data), "photo.jpg")}, headers=headers)


def post_multipart(client: FlaskClient, data: dict[str, Any], method: str = "POST",
                   headers: dict[str, str] | None = None) -> Any:
    """Like client.post(data=...), closing the temporary file werkzeug's builder spools large bodies into."""
    builder = EnvironBuilder(path="/predict", method=method, data=data, headers=headers,
                             content_type="multipart/form-data")
    try:
        environ = builder.get_environ()
        try:
            return client.open(environ)
        finally:
            environ["wsgi.input"].close()
    finally:
        builder.close()


def make_app(tmp_path: Path, **settings: Any) -> App:
    triton, legacy = EchoBackend("triton"), EchoBackend("legacy")
    values = with_traffic({"model_repository": write_model_repo(tmp_path / "repo"),
                           "flag_file": tmp_path / "traffic.json", "batch_delay_ms": 0.0, **settings})
    flask = create_app(Settings(**values), backends={"triton": triton, "legacy": legacy})
    return App(flask, flask.test_client(), triton, legacy, values["flag_file"])


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    made = make_app(tmp_path)
    yield made
    made.flask.extensions["shim"].close()


def send(client: FlaskClient, upload: Upload) -> Any:
    """An Upload (requests-style arguments) through Flask's test client."""
    kwargs = dict(upload.kwargs)
    if upload.files is not None:
        data = {name: (io.BytesIO(body), filename) for name, (filename, body) in upload.files.items()}
        return post_multipart(client, data, method=upload.method)
    if "json" in kwargs:
        return client.open("/predict", method=upload.method, json=kwargs["json"])
    return client.open("/predict", method=upload.method, data=kwargs.get("data"), headers=kwargs.get("headers"))


def test_an_image_gets_the_contracts_answer_from_triton(app: App) -> None:
    answer = app.predict()
    assert answer.status_code == 200, answer.json
    assert answer.content_type == "application/json"
    body = answer.json
    assert list(body) == ["model", "predictions"] and body["model"] == "resnet50"
    assert len(body["predictions"]) == 5
    assert all(list(p) == ["label", "class_id", "score"] for p in body["predictions"])
    assert body["predictions"][0]["label"] == f"class {body['predictions'][0]['class_id']}"
    assert answer.headers["X-Shim-Backend"] == "triton"
    assert app.triton.batches == [1] and app.legacy.batches == []


@pytest.mark.parametrize("upload", valid_uploads(), ids=lambda u: u.name)
def test_every_image_kind_the_contract_accepts_is_answered(app: App, upload: Upload) -> None:
    answer = send(app.client, upload)
    assert answer.status_code == 200, answer.json
    assert len(answer.json["predictions"]) == 5


@pytest.mark.parametrize("upload", bad_uploads(), ids=lambda u: u.name)
def test_bad_input_gets_its_4xx_in_the_contracts_shape(app: App, upload: Upload) -> None:
    answer = send(app.client, upload)
    assert answer.status_code == upload.status, answer.json
    assert set(answer.json) == {"error", "message"} and answer.json["message"]
    assert app.triton.batches == [], "bad input must never reach a backend"


def test_an_eps_upload_is_a_400_not_a_postscript_run(app: App) -> None:
    """Pillow would hand EPS to Ghostscript (app/preprocess.py, EPS_PREFIXES): the shim refuses it as a format
    it does not read, before any backend sees it."""
    eps = Upload("eps", 400, files={"image": ("figure.eps", encode(photo(64, 48), "EPS"))})
    answer = send(app.client, eps)
    assert answer.status_code == 400 and answer.json["error"] == "invalid_image", answer.json
    assert "not an image format this service reads" in answer.json["message"]
    assert app.triton.batches == [] and app.legacy.batches == []


@pytest.mark.parametrize("name", malformed_uploads())
def test_a_file_that_trips_pillow_is_a_400_not_a_500(app: App, name: str) -> None:
    data, raised = malformed_uploads()[name]
    answer = send(app.client, Upload(name, 400, files={"image": ("upload.bin", data)}))
    assert answer.status_code == 400 and answer.json["error"] == "invalid_image", answer.json
    assert raised.__name__ in answer.json["message"]


def test_too_many_form_parts_says_so_not_that_the_upload_is_too_big(app: App) -> None:
    parts = {f"f{i}": "x" for i in range(1001)}
    answer = post_multipart(app.client, parts)
    assert answer.status_code == 413
    assert answer.json["error"] == "too_large" and "1,000 form parts" in answer.json["message"], answer.json
    assert "16,777,216" not in answer.json["message"]


@pytest.mark.parametrize(("failure", "status", "code"), [
    ("down", 503, "backend_unavailable"), ("broken", 502, "backend_error"), ("hang", 504, "backend_timeout")])
def test_a_failing_backend_becomes_the_contracts_5xx(tmp_path: Path, failure: str, status: int, code: str) -> None:
    app = make_app(tmp_path, triton_timeout_s=0.3)
    if failure == "hang":
        app.triton.hang.set()
    else:
        setattr(app.triton, failure, True)
    try:
        answer = app.predict()
    finally:
        app.triton.hang.clear()
    assert answer.status_code == status, answer.json
    assert answer.json["error"] == code and set(answer.json) == {"error", "message"}
    app.flask.extensions["shim"].close()


def test_fallback_answers_from_legacy_and_the_header_says_so(tmp_path: Path) -> None:
    app = make_app(tmp_path, fallback=True)
    app.triton.down = True
    answer = app.predict()
    assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == "legacy"
    app.flask.extensions["shim"].close()


def test_request_ids_are_echoed_when_valid_and_made_otherwise(app: App) -> None:
    assert app.predict(headers={"X-Request-ID": "client-abc-123"}).headers["X-Request-ID"] == "client-abc-123"
    made = app.predict(headers={"X-Request-ID": "bad id; with spaces"}).headers["X-Request-ID"]
    assert len(made) == 32 and made.isalnum()
    assert app.client.get("/nowhere").headers["X-Request-ID"]
    assert app.triton.request_ids[0] == ["client-abc-123"]


def test_health_answers_and_readiness_names_each_backend(tmp_path: Path) -> None:
    app = make_app(tmp_path, mode=Mode.CANARY, canary_percent=10)
    assert app.client.get("/healthz").json == {"status": "ok"}
    ready = app.client.get("/readyz")
    assert ready.status_code == 200 and ready.json["mode"] == "canary"
    assert set(ready.json["backends"]) == {"legacy", "triton"}
    app.triton.down = True
    not_ready = app.client.get("/readyz")
    assert not_ready.status_code == 503 and not_ready.json["backends"]["triton"]["ready"] is False
    app.flask.extensions["shim"].close()


def shim_traffic(app: App, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """The shim-traffic command, as an operator runs it beside the shim (its SHIM_* environment)."""
    from app.traffic import main

    monkeypatch.setattr("app.capabilities.legacy_lacks", lambda path: None)  # the fake legacy backend runs anywhere
    repo = app.flask.extensions["shim"].settings.model_repository
    monkeypatch.setenv("SHIM_MODEL_REPOSITORY", str(repo))
    monkeypatch.setenv("SHIM_FLAG_FILE", str(app.flag_file))
    return main(list(args))


def traffic_once(app: App, mode: str, deadline_s: float = 5.0) -> dict[str, Any]:
    """GET /traffic until the app follows the flag file to `mode` (it re-reads it every half second)."""
    import time

    deadline = time.monotonic() + deadline_s
    while True:
        view: dict[str, Any] = app.client.get("/traffic").json
        if view["mode"] == mode or time.monotonic() > deadline:
            return view
        time.sleep(0.05)


def test_shim_traffic_switches_the_app_and_the_file_says_who_and_why(app: App, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert shim_traffic(app, monkeypatch, "set", "canary", "--canary-percent", "100", "--reason", "ramp") == 0
    printed = json.loads(capsys.readouterr().out)
    view = traffic_once(app, "canary")
    assert (view["mode"], view["canary_percent"], view["reason"]) == ("canary", 100, "ramp") == \
        (printed["mode"], printed["canary_percent"], printed["reason"])
    assert view["updated_by"].startswith("shim-traffic") and view["source"] == "flag-file"
    assert app.predict().headers["X-Shim-Backend"] == "triton"
    assert shim_traffic(app, monkeypatch, "set", "legacy") == 0
    assert traffic_once(app, "legacy")["mode"] == "legacy"
    assert app.predict().headers["X-Shim-Backend"] == "legacy"
    assert json.loads(app.flag_file.read_text())["canary_percent"] == 100  # a partial change keeps the rest
    assert shim_traffic(app, monkeypatch, "show") == 0 and '"mode": "legacy"' in capsys.readouterr().out


def test_shim_traffic_refuses_a_bad_share_and_changes_nothing(app: App, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = app.client.get("/traffic").json
    assert shim_traffic(app, monkeypatch, "set", "canary", "--canary-percent", "101") == 2
    assert "canary_percent must be a whole number from 0 to 100" in capsys.readouterr().err
    assert app.client.get("/traffic").json == before and not app.flag_file.exists()


def test_traffic_is_read_only_over_http_and_a_request_cannot_pick_its_backend(app: App) -> None:
    assert app.client.put("/traffic", json={"mode": "legacy"}).status_code == 405
    assert app.client.put("/admin/traffic", json={"mode": "legacy"}).status_code == 404
    assert app.predict(headers={"X-Shim-Backend": "legacy"}).headers["X-Shim-Backend"] == "triton"


def test_metrics_count_each_answer_by_backend_and_status(app: App) -> None:
    def count(backend: str, status: str) -> float:
        text = app.client.get("/metrics").get_data(as_text=True)
        want = f'shim_requests_total{{backend="{backend}",mode="triton",status="{status}"}}'
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))

    ok, bad = count("triton", "200"), count("none", "400")
    app.predict()
    app.predict(b"not an image")
    assert count("triton", "200") == ok + 1 and count("none", "400") == bad + 1


def test_cpu_seconds_count_each_part_and_the_request_holds_its_stages(app: App) -> None:
    def cpu() -> dict[str, float]:
        text = app.client.get("/metrics").get_data(as_text=True)
        found = {}
        for line in text.splitlines():
            if line.startswith("shim_cpu_seconds_total{") and 'backend="triton"' in line:
                found[line.split('part="')[1].split('"')[0]] = float(line.split()[-1])
        return found

    before = cpu()
    assert set(before) == {"request", "decode", "preprocess", "postprocess", "send"}  # from the start, at zero
    for _ in range(3):
        assert app.predict(encode(photo(640, 480, seed=6), "JPEG")).status_code == 200
    spent = {part: value - before[part] for part, value in cpu().items()}
    assert spent["decode"] > 0 and spent["preprocess"] > 0 and spent["send"] > 0 and spent["postprocess"] > 0
    # One thread's clock: the request's CPU holds its own stages (send and postprocess are the sender's).
    assert spent["request"] >= spent["decode"] + spent["preprocess"]


def test_a_wrong_method_is_405_and_names_the_allowed_ones(app: App) -> None:
    answer = app.client.get("/predict")
    assert answer.status_code == 405 and answer.json["error"] == "method_not_allowed"
    assert answer.headers["Allow"] == "OPTIONS, POST"


@pytest.mark.parametrize(("status", "reason", "detail", "code"), [
    (400, "Bad Request", "Invalid Request Line 'GARBAGE'", "bad_request"),
    (431, "Request Header Fields Too Large", "Error parsing headers: 'limit request headers fields'", "bad_request"),
    (400, "Bad Request", "Invalid chunk size: b'zz'", "invalid_body"),
    (500, "Internal Server Error", "", "internal_error"),
])
def test_what_gunicorn_answers_itself_is_in_the_contracts_shape(status: int, reason: str, detail: str,
                                                               code: str) -> None:
    from app.contract import server_error_response

    head, _, body = server_error_response(status, reason, detail).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == f"HTTP/1.1 {status} {reason}" and "Content-Type: application/json" in lines
    assert f"Content-Length: {len(body)}" in lines and "Connection: close" in lines
    answer = json.loads(body)
    assert answer["error"] == code and set(answer) == {"error", "message"}
    assert (detail in answer["message"]) if status < 500 else answer["message"] == "internal error"
