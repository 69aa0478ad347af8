"""The table of uploads the contract tests send: every image kind a client may send, and bad input."""

from __future__ import annotations

import functools
import io
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from tests.support import encode, photo


@dataclass(frozen=True)
class Upload:
    """One request to POST /predict (or another method), as keyword arguments for requests."""

    name: str
    status: int
    files: dict[str, Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    method: str = "POST"

    def send(self, base_url: str, session: Any = None) -> Any:
        import requests

        return (session or requests).request(self.method, base_url + "/predict", files=self.files, timeout=120,
                                             **self.kwargs)


def image_upload(name: str, data: bytes, filename: str = "image") -> Upload:
    return Upload(name, 200, files={"image": (filename, data)})


def animated_gif() -> bytes:
    frames = [Image.fromarray(photo(320, 240, seed=s)).convert("P") for s in (11, 12, 13)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG that claims width x height pixels: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def malformed_uploads() -> dict[str, tuple[bytes, type[Exception]]]:
    """Uploads a fuzzer found (app.preprocess.decode's docstring), each with what Pillow itself raises on them:
    neither is an OSError or a ValueError, so only a decoder that takes any parser failure as the upload's refuses
    them with a 400."""
    dds = bytearray(encode(photo(64, 48, seed=14), "DDS"))
    dds[80:84] = bytes(4)  # the pixel format's flags: none that Pillow knows
    spider = bytearray(encode(Image.fromarray(photo(64, 48, seed=15)).convert("L"), "SPIDER"))
    spider[107] = 90  # a header float that makes it a stack, whose offset Pillow's plugin never sets
    return {"dds of an unknown pixel format": (bytes(dds), NotImplementedError),
            "spider of a broken stack header": (bytes(spider), AttributeError)}


def valid_uploads() -> list[Upload]:
    return list(_valid_uploads())


@functools.cache  # three test modules parametrize over these at collection: make the 12 MP photo once
def _valid_uploads() -> tuple[Upload, ...]:
    rgb = photo(640, 480, seed=1)
    cmyk = Image.fromarray(photo(500, 400, seed=4)).convert("CMYK")
    rgba = Image.fromarray(np.dstack([photo(300, 300, seed=5), np.full((300, 300), 180, np.uint8)]), "RGBA")
    return (
        image_upload("jpeg", encode(rgb, "JPEG", quality=90), "photo.jpg"),
        image_upload("png", encode(photo(400, 300, seed=2), "PNG"), "photo.png"),
        image_upload("grayscale jpeg", encode(Image.fromarray(photo(480, 640, seed=3)).convert("L"), "JPEG")),
        image_upload("cmyk jpeg", encode(cmyk, "JPEG")),
        image_upload("rgba png", encode(rgba, "PNG")),
        image_upload("palette png", encode(Image.fromarray(photo(256, 256, seed=6)).convert("P"), "PNG")),
        image_upload("animated gif", animated_gif(), "anim.gif"),
        image_upload("webp", encode(photo(350, 250, seed=8), "WEBP", quality=85), "photo.webp"),
        image_upload("large jpeg 4000x3000", encode(photo(4000, 3000, seed=9), "JPEG", quality=80)),
        image_upload("1x1 png", encode(photo(1, 1, seed=10), "PNG")),
    )


def bad_uploads() -> list[Upload]:
    jpeg = encode(photo(640, 480, seed=1), "JPEG")
    rng = np.random.default_rng(42)
    return [
        Upload("no image field", 400, kwargs={"data": {"note": "hello"}}),
        Upload("misnamed field", 400, files={"file": ("photo.jpg", jpeg)}),
        Upload("json body", 400, kwargs={"json": {"image": "aGVsbG8="}}),
        Upload("empty file", 400, files={"image": ("empty.jpg", b"")}),
        Upload("text file", 400, files={"image": ("notes.txt", b"this is not an image\n" * 20)}),
        Upload("random bytes", 400, files={"image": ("noise.bin", rng.bytes(50_000))}),
        Upload("truncated jpeg", 400, files={"image": ("cut.jpg", jpeg[: len(jpeg) // 2])}),
        Upload("decompression bomb", 413, files={"image": ("bomb.png", png_header_only(30_000, 30_000))}),
        Upload("upload over the limit", 413, files={"image": ("big.jpg", b"\xff" * (17 * 1024 * 1024))}),
        Upload("wrong method", 405, method="GET"),
    ]
