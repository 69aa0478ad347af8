"""Uploaded bytes -> RGB PIL image -> normalised FP32 CHW array, as the legacy app's torchvision does.

The legacy app runs Resize(256) -> CenterCrop(224) -> ToTensor -> Normalize(ImageNet mean/std) on a
PIL image. This module gives the same tensor (bit for bit) with Pillow and numpy, no torch: the same
Pillow bilinear resize with torchvision's output size, the same crop offsets, and a per-channel lookup
table that holds, for each of the 256 pixel values, what ToTensor + Normalize compute in float32.
Everything is built once; the functions hold no state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from app.errors import EmptyImage, InvalidImage, TooLarge

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    resize: int = 256
    crop: int = 224
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    max_pixels: int = 40_000_000  # refused before decoding (decompression bombs)
    # ToTensor + Normalize for every uint8 value, per channel: shape (3, 256).
    table: npt.NDArray[np.float32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = np.arange(256, dtype=np.float32) / np.float32(255)  # ToTensor: float32 division by 255
        mean = np.asarray(self.mean, dtype=np.float32)[:, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None]
        object.__setattr__(self, "table", (values[None, :] - mean) / std)  # Normalize: sub, then div

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.crop, self.crop)


def configure_pillow(spec: ImageSpec) -> None:
    """Make sure Pillow's own bomb guard never refuses what the shim accepts.

    decode() checks the size from the header against spec.max_pixels itself, with a clear message;
    Pillow's guard (about 89 M pixels by default) stays as a second line of defence, raised only when
    the shim's limit is set higher.
    """
    if Image.MAX_IMAGE_PIXELS is not None and spec.max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = spec.max_pixels


def decode(data: bytes, spec: ImageSpec) -> Image.Image:
    """Bytes -> RGB image, or the contract's error. Only the header is read before the size check."""
    if not data:
        raise EmptyImage()
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > spec.max_pixels:
            raise TooLarge(f"image is {width}x{height} pixels; the limit is {spec.max_pixels:,} pixels")
        image.load()  # decodes (the first frame of an animation); truncated files fail here
        return image if image.mode == "RGB" else image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise TooLarge(f"image is too large to decode safely: {e}") from e
    except UnidentifiedImageError as e:
        raise InvalidImage("the uploaded file is not an image format this service reads") from e
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InvalidImage(f"the uploaded file is not a readable image ({type(e).__name__}: {e})") from e


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """torchvision's Resize(int) output size: the short side becomes `short_side`, the long side scales."""
    if width <= height:
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


def crop(image: Image.Image, spec: ImageSpec) -> npt.NDArray[np.uint8]:
    """RGB image -> the uint8 HWC pixels that torchvision's Resize + CenterCrop keep: [crop, crop, 3]."""
    width, height = image.size
    new_w, new_h = resized_size(width, height, spec.resize)
    if new_w * new_h > spec.max_pixels:
        raise TooLarge(f"image {width}x{height} is too elongated: resizing it would make {new_w}x{new_h} pixels")
    if (new_w, new_h) != (width, height):  # torchvision skips the resize at the target size
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top = round((new_h - spec.crop) / 2.0)
    left = round((new_w - spec.crop) / 2.0)
    return np.asarray(image.crop((left, top, left + spec.crop, top + spec.crop)))  # copies only the crop


def normalize(pixels: npt.NDArray[np.uint8], spec: ImageSpec) -> npt.NDArray[np.float32]:
    """uint8 HWC pixels -> float32 CHW, as ToTensor + Normalize compute it (a table lookup per channel)."""
    out = np.empty((3, *pixels.shape[:2]), dtype=np.float32)
    for channel in range(3):
        np.take(spec.table[channel], pixels[:, :, channel], out=out[channel])
    return out


def to_tensor(image: Image.Image, spec: ImageSpec) -> npt.NDArray[np.float32]:
    """RGB image -> float32 array of spec.shape, equal to the torchvision pipeline's output."""
    return normalize(crop(image, spec), spec)


@dataclass(frozen=True)
class Prepared:
    """One image as the backends take it: its cropped pixels, and their FP32 tensor when made already.

    A backend that takes pixels (the uint8 transport) gets `pixels`; the others get `fp32()`, made in the
    request thread when the decided backend wants it, else on demand (a fallback, a shadow call). With the
    encoded transport an upload that Triton decodes itself carries its bytes as they came (`encoded`) and
    no pixels: `uint8()` and `fp32()` decode it here only if another backend needs them (a fallback).
    """

    pixels: npt.NDArray[np.uint8] | None
    spec: ImageSpec
    tensor: npt.NDArray[np.float32] | None = None
    encoded: bytes | None = None  # the upload's bytes, for the encoded transport (app/sniff.py decides)

    def uint8(self) -> npt.NDArray[np.uint8]:
        """The cropped pixels; decoded from `encoded` the first time they are needed, with the legacy rules
        (raises the contract's InvalidImage / TooLarge as decode() and crop() do)."""
        if self.pixels is None:
            if self.encoded is None:
                raise ValueError("a Prepared image holds neither pixels nor the upload's bytes")
            object.__setattr__(self, "pixels", crop(decode(self.encoded, self.spec), self.spec))
        assert self.pixels is not None
        return self.pixels

    def fp32(self) -> npt.NDArray[np.float32]:
        return self.tensor if self.tensor is not None else normalize(self.uint8(), self.spec)


def forwarded(data: bytes, spec: ImageSpec) -> Prepared:
    """An upload that Triton decodes itself (the encoded transport): its bytes as they came, no pixels yet."""
    return Prepared(None, spec, encoded=data)


def prepare(image: Image.Image, spec: ImageSpec, *, fp32: bool) -> Prepared:
    pixels = crop(image, spec)
    return Prepared(pixels, spec, normalize(pixels, spec) if fp32 else None)
