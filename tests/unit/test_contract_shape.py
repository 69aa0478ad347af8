"""A team whose legacy app answered in another shape changes app/contract.py and nothing else.

The example: an app that answered {"model_name", "top": {"name", "confidence"}, "all": [...]}. Replacing
contract.prediction_body (what that team would edit in app/contract.py) is all it takes: every answer of the
shim, whatever backend gave it, comes in that shape; errors keep theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from app import contract
from app.contract import Prediction
from tests.support import encode, photo
from tests.unit.test_api import make_app, post_multipart


def team_prediction_body(model: str, predictions: Sequence[Prediction]) -> dict[str, Any]:
    """What the other team's app answered (their version of contract.prediction_body)."""
    return {"model_name": model,
            "top": {"name": predictions[0].label, "confidence": round(predictions[0].score, 4)},
            "all": [{"name": p.label, "id": p.class_id, "confidence": round(p.score, 4)} for p in predictions]}


def test_another_answer_shape_is_one_function_of_the_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "prediction_body", team_prediction_body)  # the one edit, in app/contract.py
    app = make_app(tmp_path)
    try:
        import io

        answer = post_multipart(app.client, {"image": (io.BytesIO(encode(photo(64, 48))), "photo.jpg")})
        assert answer.status_code == 200, answer.get_json()
        body = answer.get_json()
        assert list(body) == ["model_name", "top", "all"] and body["model_name"] == "resnet50"
        assert body["top"]["name"] == body["all"][0]["name"] and len(body["all"]) == 5
        assert all(list(p) == ["name", "id", "confidence"] for p in body["all"])
        refused = post_multipart(app.client, {"image": (io.BytesIO(b"not an image"), "x.jpg")})
        assert refused.status_code == 400 and refused.get_json()["error"] == "invalid_image"
    finally:
        app.flask.extensions["shim"].close()
