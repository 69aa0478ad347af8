"""Triton stopped under a running shim: contract 503s and readiness 503, then recovery on its own.

Triton serves modelrepo/standin.py's copy of triton_repo (numpy models with the same interfaces): what is
tested is the shim's behaviour around a server that goes away, and a server without torch stubs starts in
a few seconds (twice here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from app.breaker import FAILURES
from devstack import EmbeddedTriton
from tests.conftest import start_shim, start_triton
from tests.support import encode, metric_max, photo, scrape, wait_until

pytestmark = pytest.mark.triton
TIMEOUT_S = 3


def test_predict_and_readiness_turn_503_while_triton_is_down_and_recover(tmp_path: Path,
                                                                         test_model_pt: Path) -> None:
    from modelrepo.standin import write_standin_repo

    repo = write_standin_repo(tmp_path / "triton_repo")
    triton = start_triton(repo, tmp_path / "cache")
    shim = start_shim(tmp_path, triton_url=triton.http_url, repo=repo, model_pt=test_model_pt,
                      triton_timeout_s=TIMEOUT_S, workers=1)
    image = encode(photo(640, 480), "JPEG")
    try:
        shim.wait("/readyz")
        assert requests.post(shim.url + "/predict", files={"image": image}, timeout=60).status_code == 200

        triton.stop(graceful=False)
        # A refused connection is answered within the timeouts, not after some long hang.
        down = requests.post(shim.url + "/predict", files={"image": image}, timeout=TIMEOUT_S * 2 + 5)
        assert down.status_code == 503, down.text
        assert down.json()["error"] == "backend_unavailable"
        assert set(down.json()) == {"error", "message"}
        for _ in range(FAILURES):  # the breaker opens: later requests are refused without calling Triton
            again = requests.post(shim.url + "/predict", files={"image": image}, timeout=60)
            assert again.status_code == 503 and again.json()["error"] == "backend_unavailable"
        assert "circuit is open" in again.json()["message"]
        assert metric_max(scrape(shim.url + "/metrics"), "shim_circuit_open", backend="triton") == 1
        ready = requests.get(shim.url + "/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert "unreachable" in ready.json()["backends"]["triton"]["detail"]

        triton = EmbeddedTriton(triton.config).start()  # same ports: the shim's address is unchanged

        def recovered() -> bool:
            return requests.get(shim.url + "/readyz", timeout=30).status_code == 200

        wait_until(recovered, 60, "the shim's readiness to recover")  # which half-opens the circuit
        for _ in range(4):
            again = requests.post(shim.url + "/predict", files={"image": image}, timeout=60)
            assert again.status_code == 200, again.text
        assert metric_max(scrape(shim.url + "/metrics"), "shim_circuit_open", backend="triton") == 0
    finally:
        shim.stop(graceful=False)
        triton.stop(graceful=False)
