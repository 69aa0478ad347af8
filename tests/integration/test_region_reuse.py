"""Triton stopped (SIGSTOP) past the shim's timeout under load, then resumed: no request is ever answered
with another's logits, over shared memory (tensors and pixels) and over HTTP.

After a client-side timeout Triton still holds the request, and will read its input region and write its
output region when it resumes. A sender must then never write that pair again: it retires it (a new pair
with a new name) and unregisters it once Triton lets it. Each answered image is checked against its own
logits, computed beforehand (distinct images, distinct logits); the pairs in use when Triton stopped must be
gone afterwards, from /dev/shm and from Triton's registry.

Triton serves modelrepo/standin.py's numpy models (deterministic logits, one per slice of the input) with
a sleep of SLOW_S per image in the classifier: executions last, without taking the shared cores, and its two
instances overlap, as a loaded GPU's would.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from app.backends import shm
from app.backends.triton import TritonBackend
from app.errors import BackendError
from app.preprocess import ImageSpec, decode, prepare
from devstack import EmbeddedTriton
from tests.conftest import start_triton
from tests.support import encode, photo, wait_until

pytestmark = pytest.mark.triton
SPEC = ImageSpec()
TIMEOUT_S = 1.0  # the shim's timeout: the stop lasts three of them
STOP_S = 3.0
TRANSPORTS = ("shm", "uint8-shm", "http")
THREADS = 2  # sender threads per transport, each with its own client and region pair
SLOW_S = 0.01  # the classifier's time per image
POOL = [prepare(decode(encode(photo(320, 240, seed=100 + i), "JPEG"), SPEC), SPEC, fp32=False) for i in range(24)]


def backend(url: str, transport: str, timeout_s: float = TIMEOUT_S) -> TritonBackend:
    return TritonBackend(url=url, model="resnet50", version="", connect_timeout_s=1, network_timeout_s=timeout_s,
                         readiness_timeout_s=5, image_shape=SPEC.shape, classes=1000, max_batch_size=8,
                         transport=transport)


@pytest.fixture
def slow_triton(tmp_path: Path) -> Iterator[EmbeddedTriton]:
    from modelrepo.standin import write_standin_repo

    repo = write_standin_repo(tmp_path / "triton_repo")
    model = repo / "resnet50" / "1" / "model.py"
    code = model.read_text()
    line = next((x for x in code.splitlines(keepends=True) if x.strip().startswith("merged = ")), None)
    assert line, "modelrepo/triton_models/near_free_classifier.py changed: update this test"
    slowed = code.replace(line, line + f"        __import__('time').sleep({SLOW_S} * len(merged))\n")
    model.write_text(slowed)
    server = start_triton(repo, tmp_path / "cache")
    yield server
    server.stop(graceful=False)


def registered(triton: EmbeddedTriton) -> set[str]:
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/systemsharedmemory/status", timeout=30) as answer:
        return {r["name"] for r in json.loads(answer.read())}


def my_owners() -> set[str]:
    """The owners of shared memory regions in this process (one per backend), from their lock files."""
    return {token for token, info in shm.owners().items() if info.get("pid") == os.getpid()}


def pairs(owners: set[str]) -> set[str]:
    """The region pairs of these owners in /dev/shm ("shim_<owner>_<n>"), the probe region aside."""
    return {p.name.rsplit("_", 1)[0] for p in shm.SHM_DIR.glob(shm.PREFIX + "_*")
            if shm.owner_of(p.name) in owners and not p.name.endswith(("probe", shm.LOCK_SUFFIX))}


@dataclass
class Load:
    backends: dict[str, TritonBackend]
    stop: threading.Event = field(default_factory=threading.Event)
    answered: list[tuple[str, list[int], np.ndarray]] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)

    def run(self, transport: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            picks = rng.sample(range(len(POOL)), rng.randint(1, 6))
            try:
                logits = self.backends[transport].infer([POOL[i] for i in picks], [f"{seed}-{i}" for i in picks])
            except BackendError as e:
                self.failed[e.code] = self.failed.get(e.code, 0) + 1
                continue
            self.answered.append((transport, picks, logits))


def test_no_request_is_answered_with_another_requests_logits_after_a_stop_past_the_timeout(
        slow_triton: EmbeddedTriton) -> None:
    triton = slow_triton
    reference = backend(triton.http_url, "http", timeout_s=120)
    try:
        expected = reference.infer(POOL, [f"expected-{i}" for i in range(len(POOL))])
    finally:
        reference.close()
    gaps = [np.abs(expected[i] - expected[j]).max() for i in range(len(POOL)) for j in range(i)]
    assert min(gaps) > 1e-2, "the images must have logits far enough apart to tell them apart"

    others = my_owners()  # backends of other tests in this process, if any
    load = Load({t: backend(triton.http_url, t) for t in TRANSPORTS})
    threads = [threading.Thread(target=load.run, args=(t, 10 * n + k)) for n, t in enumerate(TRANSPORTS)
               for k in range(THREADS)]
    assert triton.pid is not None
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(load.answered) >= 30, 120, "answers before the stop")
        owners = my_owners() - others
        before = pairs(owners)
        assert len(owners) == 2 and len(before) == 2 * THREADS, before  # a pair per shared-memory sender thread
        os.kill(triton.pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)  # the scenario itself: a hang three times the shim's timeout, under load
        finally:
            os.kill(triton.pid, signal.SIGCONT)
        answered_at_resume = len(load.answered)
        wait_until(lambda: len(load.answered) >= answered_at_resume + 60, 120, "answers after the stop")
        # The pairs that were in use when Triton stopped are never used again; once Triton has let go of
        # them they are gone from its registry too (unregistering is retried while it refuses).
        wait_until(lambda: not before & pairs(owners) and not {f"{n}_{s}" for n in before for s in ("in", "out")}
                   & registered(triton), 60, "the stopped pairs to be retired and unregistered")
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=60)
        for b in load.backends.values():
            b.close()
    assert load.failed.get("backend_timeout", 0) >= len(threads), load.failed  # the stop did time requests out
    wrong = []
    for transport, picks, logits in load.answered:
        for row, image in zip(logits, picks, strict=True):
            if np.abs(row - expected[image]).max() > 1e-3:
                closest = int(np.argmin([np.abs(row - e).max() for e in expected]))
                wrong.append((transport, image, closest))
    assert not wrong, f"{len(wrong)} of {sum(len(p) for _, p, _ in load.answered)} images got another's logits " \
                      f"(transport, image, whose logits they were): {wrong[:10]}"
    assert pairs(owners) == set() and not owners & set(shm.owners()), "closed backends leave nothing behind"
