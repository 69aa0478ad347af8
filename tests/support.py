"""Helpers the tests share: free ports, generated images, the torchvision reference pipeline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from tools.sample_images import encode, photo

__all__ = ["encode", "photo"]  # re-exported: the tests' images come from the same place as the bench's

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


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus endpoint as (name, labels, value)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, timeout=10).text
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def metric_max(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    values = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return max(values, default=0.0)
