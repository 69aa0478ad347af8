"""Open/recover cycles of the circuit breaker, against the real Triton: the Triton connections of the
process stay bounded (each cycle used to leave its health watcher's client, and its socket, behind)."""

from __future__ import annotations

import pytest

from app.backends.triton import TritonBackend
from app.breaker import CircuitBreaker
from devstack import EmbeddedTriton
from tests.support import connections_to, triton_backend, wait_until

pytestmark = pytest.mark.triton
CYCLES = 30


def test_many_open_and_recover_cycles_leave_no_connection_behind(triton: EmbeddedTriton) -> None:
    backend: TritonBackend = triton_backend(triton.http_url, network_timeout_s=10, max_batch_size=8)
    breaker = CircuitBreaker("triton", failures=1, reset_s=600, health=lambda: backend.ready().ready,
                             health_interval_s=0.01)
    port = triton.config.http_port
    before = connections_to(port)
    try:
        for cycle in range(CYCLES):
            breaker.record_failure()  # as after a failed batch: the watcher asks Triton until it answers
            wait_until(lambda: breaker.state == "half_open", 30, f"the health watcher to see Triton ({cycle})",
                       interval_s=0.01)
            assert breaker.allow()
            breaker.record_success()
        after = connections_to(port)
    finally:
        breaker.close()
        backend.close()
    assert after - before <= 2, f"{after - before} more connections to Triton after {CYCLES} cycles"
