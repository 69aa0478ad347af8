"""Uploaded bytes -> RGB PIL image -> normalised FP32 CHW array, as the legacy app's torchvision does.

The same tensor, bit for bit, with Pillow and numpy and no torch, as torchvision 0.29's PIL path computes it
(docs/architecture.md): its output size and Pillow filter, its crop offsets and padding, and a per-channel lookup
table of what ToTensor + Normalize give each pixel value in float32. Built once; the functions hold no state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from app.description import CROP, IMAGENET_MEAN, IMAGENET_STD, INTERPOLATION, INTERPOLATIONS, RESIZE, Size, pair
from app.errors import EmptyImage, InvalidImage, ShimError, TooLarge

if TYPE_CHECKING:
    from app.description import ModelDescription

MAX_IMAGE_PIXELS = 40_000_000  # larger uploads are refused before they are decoded (decompression bombs)
# Pillow hands EPS to Ghostscript, a PostScript interpreter with a record of remote code execution, and its security
# handbook says to block EPS where it is not needed: uploads that start as its EPS plugin accepts (PostScript, the
# DOS EPS binary header) never reach Pillow. Every other format Image.open reads (the legacy app's) stays.
EPS_PREFIXES = (b"%!PS", b"\xc5\xd0\xd3\xc6")
# Each interpolation a description may name -> the Pillow filter torchvision's PIL path uses for it.
PIL_FILTERS = {name: Image.Resampling(code) for name, code in INTERPOLATIONS.items()}


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    resize: Size = RESIZE  # Resize(int): the short side; Resize((h, w)): a fixed size
    crop: Size = CROP  # CenterCrop(int) or CenterCrop((h, w))
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = INTERPOLATION  # a torchvision InterpolationMode value
    max_size: int | None = None  # Resize(max_size=...): the longest the long side may become
    color: str = "convert"  # how a non-RGB upload becomes RGB: "convert" (Image.convert) or "white" (alpha on white)
    to_float: str = "divide"  # ToTensor's x / 255, or "multiply": v2's ToDtype(float32, scale=True), x * (1 / 255)
    max_pixels: int = MAX_IMAGE_PIXELS  # refused before decoding (decompression bombs)
    # ToTensor + Normalize for every uint8 value, per channel: shape (3, 256).
    table: npt.NDArray[np.float32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.interpolation not in PIL_FILTERS:
            raise ValueError(f"interpolation {self.interpolation!r} is not one of {', '.join(PIL_FILTERS)}")
        if self.color not in ("convert", "white"):
            raise ValueError(f"color {self.color!r} is not convert or white")
        if self.to_float not in ("divide", "multiply"):
            raise ValueError(f"to_float {self.to_float!r} is not divide or multiply")
        values = np.arange(256, dtype=np.float32)
        # ToTensor divides by 255; v2's ToDtype multiplies by 1 / 255 cast to float32, as torch does (another last bit)
        values = values / np.float32(255) if self.to_float == "divide" else values * np.float32(1 / 255)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None]
        object.__setattr__(self, "table", (values[None, :] - mean) / std)  # Normalize: sub, then div

    @classmethod
    def of(cls, description: ModelDescription) -> ImageSpec:
        """The shim's preprocessing for a model, from its description's [preprocess]."""
        d = description
        return cls(resize=d.resize, crop=d.crop, mean=d.mean, std=d.std, interpolation=d.interpolation,
                   max_size=d.max_size, color=d.color, to_float=d.to_float)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, *pair(self.crop))


def configure_pillow(spec: ImageSpec) -> None:
    """Pillow's own bomb guard (about 89 M pixels) never refuses what decode() accepts: it is raised only when
    spec.max_pixels is higher, and stays a second line of defence."""
    if Image.MAX_IMAGE_PIXELS is not None and spec.max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = spec.max_pixels


def open_upload(data: bytes) -> Image.Image:
    """Pillow's lazy open (the header only) of uploaded bytes; UnidentifiedImageError for EPS (EPS_PREFIXES). A
    list of every format but EPS (Image.open's `formats`) would do too, but it loads all of Pillow's plugins, after
    which the encoded route's sniff took about 25 us more in 8 threads, with 20 times the page faults."""
    if data.startswith(EPS_PREFIXES):
        raise UnidentifiedImageError("EPS is not read: Pillow would hand it to Ghostscript")
    return Image.open(io.BytesIO(data))


def decode(data: bytes, spec: ImageSpec) -> Image.Image:
    """Bytes -> RGB image, or the contract's error. Only the header is read before the size check. Any exception
    of Pillow's parsing is the upload's 400: fuzzed uploads raised more than OSError and ValueError (a DDS header
    NotImplementedError, a SPIDER header AttributeError), and each was a 500 before."""
    if not data:
        raise EmptyImage()
    try:
        image = open_upload(data)
        width, height = image.size
        if width * height > spec.max_pixels:
            raise TooLarge(f"image is {width}x{height} pixels; the limit is {spec.max_pixels:,} pixels")
        image.load()  # decodes (the first frame of an animation); truncated files fail here
        return to_rgb(image, spec)
    except (ShimError, MemoryError):  # our own refusal above; a process out of memory is not the upload's 400
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise TooLarge(f"image is too large to decode safely: {e}") from e
    except UnidentifiedImageError as e:
        raise InvalidImage("the uploaded file is not an image format this service reads") from e
    except Exception as e:  # whatever a malformed file trips in one of Pillow's 40-odd parsers
        raise InvalidImage(f"the uploaded file is not a readable image ({type(e).__name__}: {e})") from e


def to_rgb(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """A decoded image of any mode -> RGB, as the legacy app made it before its transform."""
    if image.mode == "RGB":
        return image
    if spec.color == "white" and (image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resized_size(width: int, height: int, short_side: Size, max_size: int | None = None) -> tuple[int, int]:
    """torchvision's Resize output size (width, height): a pair (height, width) is the size itself; for an int
    the short side becomes `short_side`, the long side scales (truncated); a long side past max_size becomes
    max_size and the short side scales down with it."""
    if not isinstance(short_side, int):
        return int(short_side[1]), int(short_side[0])
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = short_side, int(short_side * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if width <= height else (new_long, new_short)


def crop(image: Image.Image, spec: ImageSpec) -> npt.NDArray[np.uint8]:
    """RGB image -> the uint8 HWC pixels that torchvision's Resize + CenterCrop keep: [crop h, crop w, 3].
    A description that resizes the tensor (v2 after ToImage) is resized here with Pillow too: torch's
    antialiased resize is within one pixel level of it (ModelDescription.tolerance)."""
    width, height = image.size
    new_w, new_h = resized_size(width, height, spec.resize, spec.max_size)
    if new_w * new_h > spec.max_pixels:
        raise TooLarge(f"image {width}x{height} is too elongated: resizing it would make {new_w}x{new_h} pixels")
    if new_w < 1 or new_h < 1:  # max_size shrinks the short side of a thin strip to nothing (torchvision fails)
        raise TooLarge(f"image {width}x{height} is too elongated: resizing it to a long side of {spec.max_size} "
                       "leaves no pixel across")
    if (new_w, new_h) != (width, height):  # torchvision skips the resize at the target size
        image = image.resize((new_w, new_h), PIL_FILTERS[spec.interpolation])
    crop_h, crop_w = pair(spec.crop)
    if crop_h > new_h or crop_w > new_w:  # CenterCrop pads with zeros first (left/top get the smaller half)
        left_pad, top_pad = max(0, (crop_w - new_w) // 2), max(0, (crop_h - new_h) // 2)
        padded = np.zeros((max(crop_h, new_h), max(crop_w, new_w), 3), dtype=np.uint8)
        padded[top_pad:top_pad + new_h, left_pad:left_pad + new_w] = np.asarray(image)
        top, left = round((padded.shape[0] - crop_h) / 2.0), round((padded.shape[1] - crop_w) / 2.0)
        return np.ascontiguousarray(padded[top:top + crop_h, left:left + crop_w])
    top = round((new_h - crop_h) / 2.0)
    left = round((new_w - crop_w) / 2.0)
    return np.asarray(image.crop((left, top, left + crop_w, top + crop_h)))  # copies only the crop


def normalize(pixels: npt.NDArray[np.uint8], spec: ImageSpec) -> npt.NDArray[np.float32]:
    """uint8 HWC pixels -> float32 CHW, as ToTensor + Normalize compute it (a table lookup per channel)."""
    out = np.empty((3, *pixels.shape[:2]), dtype=np.float32)
    for channel in range(3):
        np.take(spec.table[channel], pixels[:, :, channel], out=out[channel])
    return out


def to_tensor(image: Image.Image, spec: ImageSpec) -> npt.NDArray[np.float32]:
    """RGB image -> float32 array of spec.shape, equal to the torchvision pipeline's output."""
    return normalize(crop(image, spec), spec)
