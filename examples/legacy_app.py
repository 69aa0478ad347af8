"""The legacy app: what a team ran before the migration, and the contract the shim keeps.

    LEGACY_MODEL_PATH=triton_repo/resnet50/1/model.pt gunicorn -w 1 examples.legacy_app:app

Its transform below is resnet50's. The same app serves another team's model with that team's own
torchvision transform, labels and scores (the tests and the benchmark run it so for each model they use):
    LEGACY_TRANSFORM=examples.transforms:mobilenet_v3_small LEGACY_MODEL_NAME=mobilenet_v3_small \
    LEGACY_TOP_K=3 LEGACY_MODEL_PATH=... LEGACY_LABELS_PATH=... gunicorn -w 1 examples.legacy_app:app
"""

import importlib
import io
import os

import torch
from flask import Flask, jsonify, request
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

MODEL_NAME = os.environ.get("LEGACY_MODEL_NAME", "resnet50")
TOP_K = int(os.environ.get("LEGACY_TOP_K", "5"))
SCORES = os.environ.get("LEGACY_SCORES", "softmax")  # softmax | sigmoid | probabilities
app = Flask(__name__)
app.config["MAX_CONTENT_LENGTH"] = 16 * 1024 * 1024
app.json.sort_keys = False
model = torch.jit.load(os.environ.get("LEGACY_MODEL_PATH", "triton_repo/resnet50/1/model.pt")).eval()
labels = open(os.environ.get("LEGACY_LABELS_PATH", "triton_repo/resnet50/labels.txt")).read().splitlines()
transform = transforms.Compose([
    transforms.Resize(256),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
])
if os.environ.get("LEGACY_TRANSFORM"):  # module:attribute of another team's transform
    _module, _, _attribute = os.environ["LEGACY_TRANSFORM"].partition(":")
    transform = getattr(importlib.import_module(_module), _attribute)


def error(code, message, status):
    return jsonify(error=code, message=message), status


@app.errorhandler(404)
def not_found(_):
    return error("not_found", "no such endpoint: use POST /predict", 404)


@app.errorhandler(405)
def method_not_allowed(_):
    return error("method_not_allowed", "method not allowed: use POST /predict", 405)


@app.errorhandler(413)
def too_large(_):
    return error("too_large", f"the upload is too large: the limit is {app.config['MAX_CONTENT_LENGTH']:,} bytes", 413)


@app.post("/predict")
def predict():
    if "image" not in request.files:
        return error("missing_image", "no image: send the file as multipart/form-data field 'image'", 400)
    data = request.files["image"].read()
    if not data:
        return error("empty_image", "the uploaded image is empty", 400)
    try:
        image = Image.open(io.BytesIO(data)).convert("RGB")
    except Image.DecompressionBombError:
        return error("too_large", "image is too large to decode safely", 413)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        return error("invalid_image", "the uploaded file is not a readable image", 400)
    with torch.inference_mode():
        outputs = model(transform(image).unsqueeze(0))
    probs = {"softmax": lambda x: torch.softmax(x, dim=1), "sigmoid": torch.sigmoid,
             "probabilities": lambda x: x}[SCORES](outputs)[0]
    scores, ids = probs.topk(TOP_K)
    predictions = [{"label": labels[i], "class_id": i, "score": s} for s, i in zip(scores.tolist(), ids.tolist())]
    return jsonify(model=MODEL_NAME, predictions=predictions)
