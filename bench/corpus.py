"""The agreement corpus: 200+ uploads of every kind the contract accepts (1x1 to 4000x3000; JPEG subsamplings,
progressive, grayscale, CMYK, EXIF orientations; PNG, WebP, GIF), generated in code from their index, the
same bytes on every machine, never stored in git.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tests.sample_images import photo

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "agreement-corpus"

SIZES = [(1, 1), (1, 7), (5, 3), (16, 16), (32, 20), (63, 64), (100, 81), (150, 150), (224, 224), (225, 223),
         (256, 256), (257, 301), (300, 255), (320, 240), (333, 250), (480, 640), (500, 375), (640, 427),
         (640, 480), (720, 540), (800, 600), (1024, 683), (1024, 768), (1280, 720), (1500, 1000), (1920, 1080),
         (2000, 1500), (2592, 1944), (3000, 4000), (4000, 3000), (4000, 60)]
JPEG_KINDS = ("jpeg 4:2:0 q75", "jpeg 4:2:0 q95", "jpeg 4:2:2 q90", "jpeg 4:4:4 q90", "jpeg progressive",
              "jpeg grayscale", "jpeg exif orientation", "jpeg cmyk")
OTHER_KINDS = ("png rgb", "png rgba", "png palette", "png 16-bit grayscale", "png grayscale", "webp lossy",
               "webp lossless", "gif")
KINDS = JPEG_KINDS + OTHER_KINDS
PER_SIZE = 7
LARGE = 2_500_000  # pixels: sizes above get JPEG kinds only


@dataclass(frozen=True)
class Item:
    name: str
    kind: str
    width: int
    height: int
    data: bytes


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB picture: photo()'s waves and noise with a few filled shapes on top."""
    image = Image.fromarray(photo(width, height, seed=seed))
    rng = np.random.default_rng(seed + 10_000)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 7))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, max(width, 2), 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, max(height, 2), 2))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    return image


def encode_kind(image: Image.Image, kind: str, index: int) -> bytes:
    out = io.BytesIO()
    if kind.startswith("jpeg 4:"):
        subsampling = {"4:2:0": 2, "4:2:2": 1, "4:4:4": 0}[kind.split()[1]]
        image.save(out, "JPEG", quality=int(kind.split("q")[-1]), subsampling=subsampling)
    elif kind == "jpeg progressive":
        image.save(out, "JPEG", quality=85, progressive=True)
    elif kind == "jpeg grayscale":
        image.convert("L").save(out, "JPEG", quality=90)
    elif kind == "jpeg cmyk":
        image.convert("CMYK").save(out, "JPEG", quality=90)
    elif kind == "jpeg exif orientation":
        exif = Image.Exif()
        exif[0x0112] = 2 + index % 7  # 2..8: every orientation but the upright one
        image.save(out, "JPEG", quality=90, exif=exif.tobytes())
    elif kind == "png rgb":
        image.save(out, "PNG")
    elif kind == "png rgba":
        alpha = Image.linear_gradient("L").resize(image.size)
        rgba = image.copy()
        rgba.putalpha(alpha)
        rgba.save(out, "PNG")
    elif kind == "png palette":
        image.convert("P", palette=Image.Palette.ADAPTIVE).save(out, "PNG")
    elif kind == "png 16-bit grayscale":
        gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257
        Image.fromarray(gray).save(out, "PNG")  # mode I;16
    elif kind == "png grayscale":
        image.convert("L").save(out, "PNG")
    elif kind == "webp lossy":
        image.save(out, "WEBP", quality=80)
    elif kind == "webp lossless":
        image.save(out, "WEBP", lossless=True)
    elif kind == "gif":
        image.convert("P", palette=Image.Palette.ADAPTIVE).save(out, "GIF")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return out.getvalue()


def plan(limit: int | None = None) -> list[tuple[int, int, str]]:
    """(width, height, kind) of every item, in a fixed order: PER_SIZE kinds per size, rotating."""
    planned = []
    for i, (width, height) in enumerate(SIZES):
        kinds = JPEG_KINDS if width * height > LARGE else KINDS
        for j in range(PER_SIZE if width * height <= LARGE else 4):
            planned.append((width, height, kinds[(3 * i + j) % len(kinds)]))
    return planned[:limit] if limit else planned


def items(limit: int | None = None, max_pixels: int | None = None) -> Iterator[Item]:
    """The corpus, made one item at a time (a 12 MP picture is made once for its kinds)."""
    for index, (width, height, kind) in enumerate(plan(limit)):
        if max_pixels is not None and width * height > max_pixels:
            continue
        image = _picture(width, height)
        yield Item(f"{index:03d} {kind} {width}x{height}", kind, width, height, encode_kind(image, kind, index))


@functools.lru_cache(maxsize=2)
def _picture(width: int, height: int) -> Image.Image:
    return picture(width, height, seed=width * 7 + height)


def cached(limit: int | None = None, max_pixels: int | None = None, folder: Path = CACHE) -> list[Item]:
    """items(), made once into `folder` (named after this module's hash) and read back after."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    where = folder / digest
    index = where / "index.json"
    if not index.is_file():
        where.mkdir(parents=True, exist_ok=True)
        entries = []
        for item in items():
            path = where / f"{len(entries):03d}.bin"
            path.write_bytes(item.data)
            entries.append({"name": item.name, "kind": item.kind, "width": item.width, "height": item.height,
                            "file": path.name})
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries))
        tmp.replace(index)
    entries = json.loads(index.read_text())[:limit] if limit else json.loads(index.read_text())
    return [Item(e["name"], e["kind"], e["width"], e["height"], (where / e["file"]).read_bytes()) for e in entries
            if max_pixels is None or e["width"] * e["height"] <= max_pixels]
