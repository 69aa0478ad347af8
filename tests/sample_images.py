"""Deterministic test images made in code: no downloads, the same pixels on every machine."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo(width: int = 640, height: int = 480, seed: int = 0) -> np.ndarray:
    """A deterministic HxWx3 uint8 image with smooth structure and noise, like a small photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    freq = rng.uniform(0.005, 0.05, size=3)
    channels = [127 + 100 * np.sin(freq[c] * (x + 0.7 * y) + phase[c]) for c in range(3)]
    image = np.stack(channels, axis=-1) + rng.normal(0, 12, size=(height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray | Image.Image, fmt: str = "JPEG", **save_args: object) -> bytes:
    pil = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    buffer = io.BytesIO()
    pil.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()
