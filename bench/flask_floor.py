"""The floor of any Flask front end: gunicorn + Flask that only reads the multipart upload and answers a fixed
JSON of the contract's shape (the front-end benchmark's `Flask floor` row; the shim's target is 1.3x its CPU)."""

from flask import Flask, Response, jsonify, request

ANSWER = {"model": "resnet50", "predictions": [{"label": f"class {i}", "class_id": i, "score": 0.2} for i in range(5)]}
app = Flask(__name__)


@app.post("/predict")
def predict() -> Response:
    request.files["image"].read()
    return jsonify(ANSWER)
