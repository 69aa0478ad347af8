"""Triton python-backend model: decoded RGB pixels (HWC uint8) -> normalised CHW float32.

Reproduces torchvision's Resize(256) -> CenterCrop(224) -> ToTensor -> Normalize(mean, std) on a PIL
image with Pillow and numpy alone (the python backend of the NGC Triton image has no torch): the same
Pillow bilinear resize, the same integer crop offsets, the same float32 operations in the same order.
Sizes, mean and std come from the model config's parameters, read once in initialize().
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.resize = int(params.get("resize", "256"))
        self.crop = int(params.get("crop", "224"))
        self.max_pixels = int(params.get("max_resized_pixels", "40000000"))
        self.mean = np.array([float(x) for x in params.get("mean", "0.485,0.456,0.406").split(",")],
                             dtype=np.float32).reshape(3, 1, 1)
        self.std = np.array([float(x) for x in params.get("std", "0.229,0.224,0.225").split(",")],
                            dtype=np.float32).reshape(3, 1, 1)
        (self.input_name,) = [i["name"] for i in config["input"]]
        (output,) = config["output"]
        self.output_name = output["name"]
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        if list(output["dims"]) != [3, self.crop, self.crop]:
            raise pb_utils.TritonModelException(
                f"preprocess: output dims {output['dims']} do not match crop {self.crop}")

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy()
            try:
                batch = np.stack([self.transform(image) for image in images]).astype(self.output_dtype)
            except ValueError as e:  # a bad image fails its own request, never the whole batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            out = pb_utils.Tensor(self.output_name, batch)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def transform(self, hwc: np.ndarray) -> np.ndarray:
        if hwc.ndim != 3 or hwc.shape[2] != 3 or min(hwc.shape[:2]) < 1:
            raise ValueError(f"raw_image must be HxWx3 uint8, got shape {list(hwc.shape)}")
        image = Image.fromarray(np.ascontiguousarray(hwc), "RGB")
        width, height = image.size
        # torchvision: the short side becomes `resize`, the long side int(resize * long / short).
        if width <= height:
            new_w, new_h = self.resize, int(self.resize * height / width)
        else:
            new_w, new_h = int(self.resize * width / height), self.resize
        if new_w * new_h > self.max_pixels:  # a 1x100000 strip would resize to 256x25600000
            raise ValueError(f"raw_image {width}x{height} is too elongated to resize to {self.resize}")
        if (new_w, new_h) != (width, height):
            image = image.resize((new_w, new_h), Image.BILINEAR)
        top = int(round((new_h - self.crop) / 2.0))
        left = int(round((new_w - self.crop) / 2.0))
        pixels = np.asarray(image)[top:top + self.crop, left:left + self.crop]
        chw = pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255)
        return (chw - self.mean) / self.std
