"""The legacy app and the shim, in both backends, answer the same table of requests the same way.

The shim runs under real gunicorn (2 workers) against the real embedded Triton.
"""

from __future__ import annotations

import pytest

from tests.conftest import ServedApp
from tests.uploads import Upload, bad_uploads, valid_uploads

pytestmark = pytest.mark.triton
UPLOADS = valid_uploads() + bad_uploads()
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def servers(legacy_app: ServedApp, shim_triton: ServedApp, shim_legacy: ServedApp) -> dict[str, ServedApp]:
    return {"legacy app": legacy_app, "shim (triton)": shim_triton, "shim (legacy)": shim_legacy}


def assert_same_predictions(expected: list[dict], got: list[dict], who: str) -> None:
    assert [p["label"] for p in got] == [p["label"] for p in expected], who
    assert [p["class_id"] for p in got] == [p["class_id"] for p in expected], who
    for want, have in zip(expected, got, strict=True):
        assert abs(want["score"] - have["score"]) <= SCORE_TOLERANCE, (who, want, have)


@pytest.mark.parametrize("upload", UPLOADS, ids=[u.name for u in UPLOADS])
def test_shim_answers_like_the_legacy_app(servers: dict[str, ServedApp], upload: Upload) -> None:
    answers = {name: upload.send(server.url) for name, server in servers.items()}
    reference = answers.pop("legacy app")
    assert reference.status_code == upload.status, reference.text
    body = reference.json()
    for who, answer in answers.items():
        assert answer.status_code == reference.status_code, (who, answer.text)
        assert answer.headers["Content-Type"] == "application/json", who
        got = answer.json()
        assert list(got) == list(body), (who, got)
        if reference.status_code == 200:
            assert got["model"] == body["model"]
            assert len(got["predictions"]) == 5
            assert all(list(p) == ["label", "class_id", "score"] for p in got["predictions"])
            assert_same_predictions(body["predictions"], got["predictions"], who)
        else:
            assert got["error"] == body["error"], who
            assert got["message"], who


def test_every_answer_carries_a_request_id(shim_triton: ServedApp) -> None:
    import requests

    mine = requests.get(shim_triton.url + "/predict", headers={"X-Request-ID": "client-abc-123"}, timeout=10)
    assert mine.headers["X-Request-ID"] == "client-abc-123"
    generated = requests.get(shim_triton.url + "/predict", timeout=10).headers["X-Request-ID"]
    assert len(generated) == 32 and generated != "client-abc-123"
