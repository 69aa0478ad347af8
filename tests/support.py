"""Helpers the tests share: free ports, generated images, the torchvision reference pipeline."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.preprocess import ImageSpec, decode, to_tensor
from app.scores import best, softmax
from devstack import promtext, waiting
from devstack.launch import free_port
from tests.sample_images import encode, photo

__all__ = ["encode", "photo"]  # re-exported: the tests' images come from the same place as the bench's

ROOT = Path(__file__).resolve().parent.parent
TRITON_REPO = ROOT / "triton_repo"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


_HANDED_OUT: set[int] = set()
_PORTS_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """Ports free now, never handed out before in this session, and below the kernel's ephemeral range.

    A server's ports stay unbound for seconds after they are picked (Triton binds them once its models are
    loaded) while other servers and clients start beside it. Below the ephemeral range, no bind(0) of
    another process (gunicorn's, the benchmark's) and no outgoing connection can take them meanwhile.
    """
    from devstack.server import port_is_free  # not at import: its package needs the local Triton's

    low = _ephemeral_low()
    ports: list[int] = []
    with _PORTS_LOCK:
        while len(ports) < count:
            port = random.randrange(10000, low) if low > 11000 else free_port()
            if port in _HANDED_OUT or not port_is_free("127.0.0.1", port):
                continue
            _HANDED_OUT.add(port)
            ports.append(port)
    return ports


def mutated(rng: random.Random, seeds: Sequence[bytes], count: int, *, edits: int, cut: int,
            new_byte: Callable[[], int], inserted: Callable[[], bytes]) -> Iterator[bytes]:
    """`count` fuzzed copies of `seeds`, each with 1 to `edits` edits: a byte replaced (half of them), up to `cut`
    bytes cut (a quarter) or bytes inserted (a quarter)."""
    for _ in range(count):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, edits)):
            at, kind = rng.randrange(len(data) or 1), rng.random()
            if kind < 0.5 and data:
                data[at] = new_byte()
            elif kind < 0.75:
                del data[at:at + rng.randint(1, cut)]
            else:
                data[at:at] = inserted()
        yield bytes(data)


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
    """Poll with a deadline (devstack.waiting); a timeout fails the test with what was awaited."""
    try:
        waiting.wait_until(predicate, timeout_s, what, interval_s=interval_s)
    except waiting.WaitTimeout as e:
        raise AssertionError(str(e)) from None


def scrape(url: str) -> list[promtext.Sample]:
    """Every sample of a Prometheus endpoint."""
    return promtext.scrape(url)


metric_sum = promtext.total
metric_max = promtext.maximum


class FakeClock:
    """A monotonic clock that moves only when a test says so: for the breaker, windows and polling."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def standin_answer(data: bytes, labels: list[str], top_k: int = 5) -> list[dict[str, Any]]:
    """What the shim must answer with the stand-in resnet50 (modelrepo/triton_models/near_free_classifier.py), as
    make compose-test and make k8s-test serve it: logit k is the sum of the k-th of 1000 equal slices of the
    preprocessed input."""
    spec = ImageSpec()
    flat = to_tensor(decode(data, spec), spec).reshape(1, -1)
    bounds = np.linspace(0, flat.shape[1], len(labels) + 1)[:-1].astype(np.int64)
    probs = softmax(np.add.reduceat(flat, bounds, axis=1)[0])
    return [{"label": labels[i], "class_id": i, "score": float(probs[i])} for i in best(probs, top_k)]


def connections_to(port: int, pid: int | None = None) -> int:
    """Established TCP connections of process `pid` (this one by default) to `port` on any address: read
    from /proc (the sockets the process holds, matched by inode), so nothing of the process is asked."""
    import os

    pid = pid or os.getpid()
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def triton_backend(url: str, transport: str = "fp32", *, model: str = "resnet50", version: str = "",
                   max_batch_size: int = 32, classes: int = 1000, network_timeout_s: float = 60,
                   readiness_timeout_s: float = 5, **target: Any) -> Any:
    """A TritonBackend of one transport (app/backends/triton), without a model description."""
    from app.backends.triton import TRANSPORTS, Target, TritonBackend

    target = {"uint8_model": f"{model}_uint8", "encoded_model": f"{model}_encoded", **target}
    chosen = TRANSPORTS[transport](Target(url=url, model=model, version=version, crop=(224, 224), classes=classes,
                                          **target))
    return TritonBackend(chosen, connect_timeout_s=1, network_timeout_s=network_timeout_s,
                         readiness_timeout_s=readiness_timeout_s, max_batch_size=max_batch_size)
