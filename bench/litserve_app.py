"""A peer to compare with: the same model behind LitServe 0.2.19, as a new user would serve it (batches of 8
within 10 ms, the legacy app's transform, the contract's JSON; its own 400s). Needs the dev and legacy extras.

    LITSERVE_MODEL_PATH=model.pt LITSERVE_LABELS_PATH=labels.txt LITSERVE_PORT=8000 python -m bench.litserve_app
"""


# No `from __future__ import annotations`: LitServe reads decode_request's annotation, and only the class
# Request itself (not the string "Request") makes it parse the form instead of pickling the raw request.
import io
import os
from typing import Any

import litserve as ls
import torch
from fastapi import HTTPException, Request
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

MAX_BATCH_SIZE, BATCH_TIMEOUT_S = 8, 0.01


class ClassifierAPI(ls.LitAPI):  # type: ignore[misc]
    def setup(self, device: str) -> None:
        self.model = torch.jit.load(os.environ["LITSERVE_MODEL_PATH"]).eval()
        with open(os.environ["LITSERVE_LABELS_PATH"]) as f:
            self.labels = f.read().splitlines()
        self.transform = transforms.Compose([
            transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
        # Warm before ready, as Triton's model_warmup does: TorchScript optimises per input shape in its first
        # calls (seconds each on a CPU), and LitServe's batches come in every size up to MAX_BATCH_SIZE.
        with torch.inference_mode():
            for size in range(1, MAX_BATCH_SIZE + 1):
                for _ in range(2):
                    self.model(torch.zeros(size, 3, 224, 224))

    def decode_request(self, request: Request) -> Any:  # LitServe hands over the parsed form
        upload = request.get("image")  # type: ignore[attr-defined]
        if upload is None or isinstance(upload, str):
            raise HTTPException(400, "no image: send the file as multipart/form-data field 'image'")
        try:
            image = Image.open(io.BytesIO(upload.file.read())).convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
            raise HTTPException(400, "the uploaded file is not a readable image") from e
        return self.transform(image)

    def batch(self, inputs: list[Any]) -> Any:
        return torch.stack(inputs)

    def predict(self, x: Any) -> Any:
        with torch.inference_mode():
            return torch.softmax(self.model(x), dim=1)

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, probs: Any) -> dict[str, Any]:
        scores, ids = probs.topk(5)
        return {"model": "resnet50", "predictions": [
            {"label": self.labels[i], "class_id": i, "score": s}
            for s, i in zip(scores.tolist(), ids.tolist(), strict=True)]}


if __name__ == "__main__":
    server = ls.LitServer(ClassifierAPI(max_batch_size=MAX_BATCH_SIZE, batch_timeout=BATCH_TIMEOUT_S),
                          accelerator="cpu", timeout=60)
    server.run(port=int(os.environ.get("LITSERVE_PORT", "8000")), generate_client_file=False)
