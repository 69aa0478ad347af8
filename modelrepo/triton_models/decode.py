"""Triton python-backend model: uploads' bytes (BYTES [N, 1], one per row) -> normalised FP32 CHW tensors.

The one source of every generated `<name>_decode/1/model.py`: on the instance's device, what the legacy app did
with Pillow and torchvision (docs/transports.md), from the description's decode_parameters(). A row whose upload
the decoder refused answers READABLE False and zeros: the shim decodes that upload itself; no other row fails.

Nothing is imported from the shim's package (Triton's image does not have it): resized_size is
app.preprocess.resized_size's rule, and tests/unit/test_decode_step.py holds the two equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton: the unit tests of Transform
    pb_utils = None

READABLE = "readable"  # the per-row BOOL output the shim's app/backends/triton/encoded.py reads
REQUIRED = ("resize", "crop", "interpolation", "mean", "std", "color")
OPTIONAL = ("max_size", "antialias", "resize_on", "to_float")
RESIZERS = ("nearest", "nearest-exact", "bilinear", "bicubic")  # app/description.py ENCODED_INTERPOLATIONS
COLORS = ("convert", "white")
MAX_RESIZED_PIXELS = 40_000_000  # a 1 x 100,000 strip would resize past it; the shim never sends one


def _floats(name: str, text: str) -> tuple[float, float, float]:
    values = [float(x) for x in text.split(",")]
    if len(values) != 3:
        raise ValueError(f"parameter {name} must be three comma-separated numbers, got {text!r}")
    return values[0], values[1], values[2]


def _size(name: str, text: str) -> int | tuple[int, int]:
    """One whole number (Resize's short side, a square crop) or two, "height,width"."""
    values = [int(x) for x in text.split(",")]
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f"parameter {name} must be a whole number or height,width, got {text!r}")
    return values[0] if len(values) == 1 else (values[0], values[1])


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def resized_size(width: int, height: int, short_side: int | tuple[int, int],
                 max_size: int | None = None) -> tuple[int, int]:
    """torchvision's Resize output size (app.preprocess.resized_size), (width, height): a (height, width) pair is
    the size; for an int the short side becomes it, the long side scales (truncated), then max_size applies."""
    if not isinstance(short_side, int):
        return short_side[1], short_side[0]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = short_side, int(short_side * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if width <= height else (new_long, new_short)


def nearest_index(size_in: int, size_out: int) -> Any:  # -> np.ndarray of int64
    """The source index Pillow's NEAREST resize takes for each output index (ImagingScaleAffine: the position
    starts at scale / 2 and adds scale per pixel, in double precision, truncated): a running sum, as Pillow's."""
    scale = size_in / size_out
    steps = np.full(size_out, scale, dtype=np.float64)
    steps[0] = scale * 0.5
    return np.minimum(np.cumsum(steps).astype(np.int64), size_in - 1)


class Transform:
    """Resize, CenterCrop, ToTensor, Normalize of one decoded image, from the step's parameters, on `device`."""

    def __init__(self, params: Mapping[str, str], device: Any) -> None:
        import torch
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional

        missing = [p for p in REQUIRED if p not in params]
        if missing:
            raise ValueError(f"config.pbtxt lacks the parameters {', '.join(missing)} (all of {', '.join(REQUIRED)} "
                             f"are needed, as strings; {', '.join(OPTIONAL)} is optional)")
        self.resize, self.crop = _size("resize", params["resize"]), _pair(_size("crop", params["crop"]))
        self.antialias = params.get("antialias", "true") != "false"
        self.on_tensor = params.get("resize_on", "pil") == "tensor"  # v2's Resize after ToImage: torch's, exactly
        self.multiply = params.get("to_float", "divide") == "multiply"  # v2's ToDtype(scale=True): x * (1 / 255)
        self.max_size = int(params["max_size"]) if params.get("max_size") else None
        if params["interpolation"] not in RESIZERS:
            raise ValueError(f"interpolation {params['interpolation']!r} is not one this step resizes with "
                             f"({', '.join(RESIZERS)})")
        self.nearest = params["interpolation"].startswith("nearest")  # Pillow's NEAREST, for both names
        self.interpolation = InterpolationMode(params["interpolation"])
        if params["color"] not in COLORS:
            raise ValueError(f"color {params['color']!r} is not one of {', '.join(COLORS)}")
        mean, std = _floats("mean", params["mean"]), _floats("std", params["std"])
        self.torch, self.functional, self.device = torch, functional, device
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(3, 1, 1)
        self.scale = torch.full((1, 1, 1), 255.0, dtype=torch.float32, device=device)
        self.reciprocal = torch.full((1, 1, 1), 1 / 255, dtype=torch.float32, device=device)

    def __call__(self, hwc: Any) -> Any:  # uint8 [H, W, 3] on self.device -> float32 [1, 3, crop h, crop w]
        torch = self.torch
        if hwc.ndim != 3 or hwc.shape[2] != 3 or hwc.dtype != torch.uint8:
            raise ValueError(f"decoded to {list(hwc.shape)} {hwc.dtype}, not H x W x 3 uint8")
        chw = hwc.permute(2, 0, 1)
        height, width = int(chw.shape[1]), int(chw.shape[2])
        new_w, new_h = resized_size(width, height, self.resize, self.max_size)
        if new_w * new_h > MAX_RESIZED_PIXELS or new_w < 1 or new_h < 1:
            raise ValueError(f"{width}x{height} is too elongated to resize to {self.resize}")
        if (new_w, new_h) != (width, height):
            chw = self._resized(chw, new_w, new_h)
        crop_h, crop_w = self.crop
        if crop_h > new_h or crop_w > new_w:  # CenterCrop pads with zeros first (left/top get the smaller half)
            left, top = max(0, (crop_w - new_w) // 2), max(0, (crop_h - new_h) // 2)
            padded = torch.zeros((3, max(crop_h, new_h), max(crop_w, new_w)), dtype=torch.uint8, device=chw.device)
            padded[:, top:top + new_h, left:left + new_w] = chw
            chw, new_h, new_w = padded, int(padded.shape[1]), int(padded.shape[2])
        top, left = round((new_h - crop_h) / 2.0), round((new_w - crop_w) / 2.0)
        floats = chw[:, top:top + crop_h, left:left + crop_w].to(torch.float32)
        floats = floats.mul(self.reciprocal) if self.multiply else floats.div(self.scale)
        return floats.sub(self.mean).div(self.std).unsqueeze(0).contiguous()

    def _resized(self, chw: Any, new_w: int, new_h: int) -> Any:
        if self.nearest and not self.on_tensor:
            torch = self.torch
            rows = torch.from_numpy(nearest_index(int(chw.shape[1]), new_h)).to(chw.device)
            cols = torch.from_numpy(nearest_index(int(chw.shape[2]), new_w)).to(chw.device)
            return chw.index_select(1, rows).index_select(2, cols)
        return self.functional.resize(chw, [new_h, new_w], interpolation=self.interpolation,
                                      antialias=self.antialias or not self.on_tensor)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import torch
        from nvidia import nvimgcodec

        self.torch: Any = torch  # typed loosely: torch.utils.dlpack does not re-export to_dlpack for mypy
        config = json.loads(args["model_config"])
        name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        (inp,) = config["input"]
        (out,) = [o for o in config["output"] if o["name"] != READABLE]
        self.input_name, self.output_name = inp["name"], out["name"]

        gpu = args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
        if gpu:
            device_id = int(args.get("model_instance_device_id", "0"))
            self.device = torch.device("cuda", device_id)
            torch.cuda.set_device(self.device)
            # All of nvImageCodec's backends: nvJPEG's GPU and hybrid decoders first, its CPU one for what they
            # refuse. Fancy upsampling brings the GPU's chroma close to libjpeg-turbo's (the legacy app's).
            self.decoder = nvimgcodec.Decoder(device_id=device_id, options=":fancy_upsampling=1")
        else:
            self.device = torch.device("cpu")
            instances = sum(max(int(g.get("count", 1)), 1) for g in config.get("instance_group", [])) or 1
            threads = max(1, len(os.sched_getaffinity(0)) // instances)
            torch.set_num_threads(threads)
            self.decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                              backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
                                              max_num_cpu_threads=threads)
        try:
            self.transform = Transform(params, self.device)
        except ValueError as e:
            raise pb_utils.TritonModelException(f"{name}: a parameter is not valid: {e}") from e
        crop = self.transform.crop
        if [int(d) for d in out["dims"]] != [3, *crop]:
            raise pb_utils.TritonModelException(f"{name}: output dims {out['dims']} do not match crop {crop}")
        self.decode_params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                                     color_spec=nvimgcodec.ColorSpec.SRGB)

    def execute(self, requests: list[Any]) -> list[Any]:
        uploads = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy().reshape(-1) for r in requests]
        images = iter(self._decode([np.frombuffer(bytes(u), dtype=np.uint8) for rows in uploads for u in rows]))
        crop_h, crop_w = self.transform.crop
        responses = []
        for rows in uploads:
            tensors = self.torch.zeros((len(rows), 3, crop_h, crop_w), dtype=self.torch.float32, device=self.device)
            readable = np.zeros((len(rows), 1), dtype=bool)
            for row in range(len(rows)):
                image = next(images)
                if image is None:
                    continue
                try:
                    tensors[row] = self.transform(self._on_device(image))[0]
                    readable[row, 0] = True
                except Exception:  # this upload's own failure (an odd size, memory): never its batch's
                    continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                self._output(tensors), pb_utils.Tensor(READABLE, readable)]))
        return responses

    def _decode(self, streams: list[Any]) -> list[Any]:
        """One decode call for the batch (None where an image fails); one by one if the batch call raises."""
        if not streams:
            return []
        try:
            return list(self.decoder.decode(streams, params=self.decode_params))
        except Exception:
            images = []
            for stream in streams:
                try:
                    images.append(self.decoder.decode(stream, params=self.decode_params))
                except Exception:
                    images.append(None)
            return images

    def _on_device(self, image: Any) -> Any:  # -> torch.Tensor uint8 [H, W, C] on self.device
        torch = self.torch
        on_device = "DEVICE" in str(getattr(image, "buffer_kind", ""))  # nvJPEG's output; host: a CPU decoder's
        if self.device.type == "cuda" and on_device:
            return torch.as_tensor(image, device=self.device)
        return torch.from_numpy(np.asarray(image.cpu() if on_device else image)).to(self.device)

    def _output(self, tensor: Any) -> Any:
        if self.device.type == "cuda":
            return pb_utils.Tensor.from_dlpack(self.output_name, self.torch.utils.dlpack.to_dlpack(tensor))
        return pb_utils.Tensor(self.output_name, tensor.numpy())
