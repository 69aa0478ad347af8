"""Helpers the tests share: free ports, generated images, the torchvision reference pipeline."""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
TRITON_REPO = ROOT / "triton_repo"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def free_ports(count: int) -> list[int]:
    """Ports nobody listens on now (held open together, so they are distinct)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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


def reference_transform() -> Callable[[Image.Image], np.ndarray]:
    """What a typical legacy app does: torchvision v1 transforms on a PIL image."""
    from torchvision import transforms

    pipeline = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    return lambda image: pipeline(image).numpy()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
