"""Triton python-backend model: one upload's bytes (UINT8 [1, n]) -> the normalised FP32 CHW tensor.

The shim's `encoded` transport forwards the upload as it came; this model does on the instance's device
what the legacy app did on its CPU with Pillow and torchvision (app/preprocess.py gives the same tensor):

  decode     nvImageCodec to RGB: nvJPEG on the GPU for a KIND_GPU instance, its libjpeg-turbo CPU backend
             for a KIND_CPU one (the CPU copy that `make run` and the tests serve). EXIF orientation is NOT
             applied: the legacy app's Image.open + convert("RGB") ignores it.
  resize     the short side to `resize`, the long side int(resize * long / short) (torchvision's rounding),
             skipped when the image already has that size; antialiased, with `interpolation`
             (torchvision.transforms.v2.functional.resize: uint8 on a CPU, float then rounded to uint8 on a GPU)
  crop       `crop` x `crop` at torchvision's CenterCrop offsets, round((h - crop) / 2)
  normalise  ToTensor (float32 division by 255), then (x - mean) / std per channel, divisors as tensors

Parameters (config.pbtxt `parameters`, strings): resize and crop (whole numbers), interpolation (a lowercase
torchvision InterpolationMode name: bilinear, bicubic, ...), mean and std (three comma-separated floats).

Each request is one image and gets its own response, in order. An image that the decoder refuses (or whose
transform fails) gets an error response whose message holds REFUSED; the shim recognises it and decodes that
upload itself, so the client gets exactly the legacy app's answer (400 invalid_image for a truncated JPEG).
The other requests of the batch are never failed by it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

REFUSED = "[decode_refused]"  # the shim's app/backends/triton.py looks for this in Triton's error message
PARAMETERS = ("resize", "crop", "interpolation", "mean", "std")
MAX_RESIZED_PIXELS = 40_000_000  # a 1 x 100,000 strip would resize past it; the shim never sends one


def _floats(name: str, text: str) -> list[float]:
    values = [float(x) for x in text.split(",")]
    if len(values) != 3:
        raise ValueError(f"parameter {name} must be three comma-separated numbers, got {text!r}")
    return values


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """torchvision's Resize(int) output size: the short side becomes `short_side`, the long side scales."""
    if width <= height:
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import torch
        from nvidia import nvimgcodec
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional

        self.torch, self.functional = torch, functional
        config = json.loads(args["model_config"])
        name = config["name"]
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        missing = [p for p in PARAMETERS if p not in params]
        if missing:
            raise pb_utils.TritonModelException(f"{name}: config.pbtxt lacks the parameters {', '.join(missing)} "
                                                f"(all of {', '.join(PARAMETERS)} are needed, as strings)")
        try:
            self.resize, self.crop = int(params["resize"]), int(params["crop"])
            self.interpolation = InterpolationMode(params["interpolation"])
            mean, std = _floats("mean", params["mean"]), _floats("std", params["std"])
        except ValueError as e:
            raise pb_utils.TritonModelException(f"{name}: a parameter is not valid: {e}") from e
        (inp,), (out,) = config["input"], config["output"]
        self.input_name, self.output_name = inp["name"], out["name"]
        if list(out["dims"]) != [3, self.crop, self.crop]:
            raise pb_utils.TritonModelException(f"{name}: output dims {out['dims']} do not match crop {self.crop}")

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
        self.decode_params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                                     color_spec=nvimgcodec.ColorSpec.SRGB)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(3, 1, 1)
        self.scale = torch.full((1, 1, 1), 255.0, dtype=torch.float32, device=self.device)

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        streams, where = [], []
        for i, request in enumerate(requests):
            data = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy()
            if data.ndim != 2 or data.shape[0] != 1 or data.shape[1] == 0:
                responses[i] = self._refuse(f"one image per request: UINT8 [1, n], got {list(data.shape)}")
                continue
            streams.append(data[0])
            where.append(i)
        for i, image in zip(where, self._decode(streams), strict=True):
            if image is None:
                responses[i] = self._refuse("the decoder cannot read this image")
                continue
            try:
                tensor = self.transform(image)
            except Exception as e:  # this image's own failure (an odd size, memory): never the batch's
                responses[i] = self._refuse(f"{type(e).__name__}: {e}")
                continue
            responses[i] = pb_utils.InferenceResponse(output_tensors=[self._output(tensor)])
        return responses

    def _decode(self, streams: list) -> list:
        """One decode call for the batch (nvImageCodec fails per image: None where it cannot); one by one
        if the batch call itself raises."""
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

    def transform(self, image: object):  # -> torch.Tensor [1, 3, crop, crop] float32 on self.device
        torch = self.torch
        on_device = "DEVICE" in str(getattr(image, "buffer_kind", ""))  # nvJPEG's output; host: a CPU decoder's
        if self.device.type == "cuda" and on_device:
            hwc = torch.as_tensor(image, device=self.device)
        else:
            hwc = torch.from_numpy(np.asarray(image.cpu() if on_device else image)).to(self.device)
        if hwc.ndim != 3 or hwc.shape[2] != 3 or hwc.dtype != torch.uint8:
            raise ValueError(f"decoded to {list(hwc.shape)} {hwc.dtype}, not H x W x 3 uint8")
        chw = hwc.permute(2, 0, 1)
        height, width = int(chw.shape[1]), int(chw.shape[2])
        new_w, new_h = resized_size(width, height, self.resize)
        if new_w * new_h > MAX_RESIZED_PIXELS:
            raise ValueError(f"{width}x{height} is too elongated to resize to {self.resize}")
        if (new_w, new_h) != (width, height):
            chw = self.functional.resize(chw, [new_h, new_w], interpolation=self.interpolation, antialias=True)
        top, left = int(round((new_h - self.crop) / 2.0)), int(round((new_w - self.crop) / 2.0))
        if top < 0 or left < 0:
            raise ValueError(f"{new_w}x{new_h} is smaller than the crop {self.crop}")
        pixels = chw[:, top:top + self.crop, left:left + self.crop]
        return pixels.to(torch.float32).div(self.scale).sub(self.mean).div(self.std).unsqueeze(0).contiguous()

    def _output(self, tensor: object) -> object:
        if self.device.type == "cuda":
            return pb_utils.Tensor.from_dlpack(self.output_name, self.torch.utils.dlpack.to_dlpack(tensor))
        return pb_utils.Tensor(self.output_name, tensor.numpy())

    @staticmethod
    def _refuse(why: str) -> object:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{REFUSED} {why}"))
