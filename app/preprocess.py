"""Uploaded bytes -> RGB PIL image -> normalised FP32 CHW array, as the legacy app's torchvision does.

The legacy app runs Resize(size, interpolation, max_size) -> CenterCrop(crop) -> ToTensor -> Normalize(mean,
std) on a PIL image (the defaults: Resize(256), CenterCrop(224), ImageNet's mean/std; a model's own come
from its description, app/description.py). This module gives the same tensor (bit for bit) with Pillow
and numpy, no torch, as torchvision 0.29's PIL path computes it: the same Pillow resize filter
(pil_modes_mapping: nearest-exact is Pillow's NEAREST too; antialias does not apply to PIL images) with
torchvision's output size (_compute_resized_output_size: the long side truncated, max_size applied after),
no resize when the size is already right, the same crop offsets (round((h - crop) / 2)), the same zero
padding when the crop is larger than the resized image, and a per-channel lookup table that holds, for
each of the 256 pixel values, what ToTensor + Normalize compute in float32.
Everything is built once; the functions hold no state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from app.description import CROP, IMAGENET_MEAN, IMAGENET_STD, INTERPOLATION, INTERPOLATIONS, RESIZE
from app.errors import EmptyImage, InvalidImage, TooLarge

MAX_IMAGE_PIXELS = 40_000_000  # larger uploads are refused before they are decoded (decompression bombs)
# Each interpolation a description may name -> the Pillow filter torchvision's PIL path uses for it.
PIL_FILTERS = {name: Image.Resampling(code) for name, code in INTERPOLATIONS.items()}


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    resize: int = RESIZE
    crop: int = CROP
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = INTERPOLATION  # a torchvision InterpolationMode value
    max_size: int | None = None  # Resize(max_size=...): the longest the long side may become
    color: str = "convert"  # how a non-RGB upload becomes RGB: "convert" (Image.convert) or "white" (alpha on white)
    max_pixels: int = MAX_IMAGE_PIXELS
    # ToTensor + Normalize for every uint8 value, per channel: shape (3, 256).
    table: npt.NDArray[np.float32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.interpolation not in PIL_FILTERS:
            raise ValueError(f"interpolation {self.interpolation!r} is not one of {', '.join(PIL_FILTERS)}")
        if self.color not in ("convert", "white"):
            raise ValueError(f"color {self.color!r} is not convert or white")
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
        return to_rgb(image, spec)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise TooLarge(f"image is too large to decode safely: {e}") from e
    except UnidentifiedImageError as e:
        raise InvalidImage("the uploaded file is not an image format this service reads") from e
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InvalidImage(f"the uploaded file is not a readable image ({type(e).__name__}: {e})") from e


def to_rgb(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """A decoded image of any mode -> RGB, as the legacy app made it before its transform."""
    if image.mode == "RGB":
        return image
    if spec.color == "white" and (image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resized_size(width: int, height: int, short_side: int, max_size: int | None = None) -> tuple[int, int]:
    """torchvision's Resize(int, max_size) output size: the short side becomes `short_side`, the long side
    scales (truncated); a long side past max_size becomes max_size and the short side scales down with it."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = short_side, int(short_side * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if width <= height else (new_long, new_short)


def crop(image: Image.Image, spec: ImageSpec) -> npt.NDArray[np.uint8]:
    """RGB image -> the uint8 HWC pixels that torchvision's Resize + CenterCrop keep: [crop, crop, 3]."""
    width, height = image.size
    new_w, new_h = resized_size(width, height, spec.resize, spec.max_size)
    if new_w * new_h > spec.max_pixels:
        raise TooLarge(f"image {width}x{height} is too elongated: resizing it would make {new_w}x{new_h} pixels")
    if new_w < 1 or new_h < 1:  # max_size shrinks the short side of a thin strip to nothing (torchvision fails)
        raise TooLarge(f"image {width}x{height} is too elongated: resizing it to a long side of {spec.max_size} "
                       "leaves no pixel across")
    if (new_w, new_h) != (width, height):  # torchvision skips the resize at the target size
        image = image.resize((new_w, new_h), PIL_FILTERS[spec.interpolation])
    size = spec.crop
    if size > new_w or size > new_h:  # CenterCrop pads with zeros first (left/top get the smaller half)
        left_pad, top_pad = max(0, (size - new_w) // 2), max(0, (size - new_h) // 2)
        padded = np.zeros((max(size, new_h), max(size, new_w), 3), dtype=np.uint8)
        padded[top_pad:top_pad + new_h, left_pad:left_pad + new_w] = np.asarray(image)
        top, left = round((padded.shape[0] - size) / 2.0), round((padded.shape[1] - size) / 2.0)
        return np.ascontiguousarray(padded[top:top + size, left:left + size])
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    return np.asarray(image.crop((left, top, left + size, top + size)))  # copies only the crop


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
