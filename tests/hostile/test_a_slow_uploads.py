"""(a) Slow uploads from many addresses (issue 18): 64 and 256 connections spread over 2, 4 and 8 loopback
addresses, each sending a complete /predict head (Content-Length 400000) and the first 256 KiB of its body at
once (nginx's in-memory body buffer filled: the most memory a slow upload can hold), then one byte every 3 s,
reconnecting whenever refused or closed. Meanwhile a well-behaved client from 127.0.0.1 uploads a photo after
another. Its uploads must all be answered 200 and its p99 stay within 2x of its p99 just before the attack,
measured side by side; no dripped upload may reach gunicorn, at most limit_conn of each address may be in
progress at nginx, and every refusal nginx logs must be counted in the shim's /metrics. Then what one such
upload costs nginx in memory, on a fresh nginx: at most its body buffer and the connection's own."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

from bench.loadgen import Job, LoadGenerator, Outcome, multipart_request
from devstack import proxy
from tests.hostile.clients import HOST, Drippers, percentile
from tests.hostile.conftest import Figures, Stack
from tests.support import wait_until

ATTACK_S = float(os.environ.get("HOSTILE_UPLOAD_S", "10"))
IDLE_S = 5.0
INTERVAL_S = 3.0
BODY_LENGTH = 400_000
BODY_FIRST = 256 * 1024  # the edge server's client_body_buffer_size: the rest would go to a temporary file
CONNECTION_KIB = 16  # what nginx keeps per connection besides the body buffer (measured: about 10 KiB)


def one_client(port: int, image: bytes, duration_s: float) -> Job:
    upload = multipart_request(HOST, port, "/predict", "image", "test.jpg", "image/jpeg", image)
    return Job(HOST, port, (upload,), expect=b'"predictions"', concurrency=1, warmup_s=1.0, duration_s=duration_s,
               timeout_s=30)


def errors(outcome: Outcome) -> dict[str, int]:
    return dict(Counter(e for e in outcome.errors if e))


@pytest.mark.parametrize("addresses", [2, 4, 8])
@pytest.mark.parametrize("connections", [64, 256])
def test_slow_uploads_from_many_addresses_deny_no_one(healthy: Stack, figures: Figures, connections: int,
                                                      addresses: int) -> None:
    stack = healthy
    assert stack.directive("client_body_buffer_size") == "256k", "BODY_FIRST fills the edge's body buffer"
    per_client = stack.predict_limits()["shim_predict_per_client"]
    sources = [f"127.0.2.{i}" for i in range(1, addresses + 1)]
    counts_before = stack.proxy_counts()
    mark = stack.log_mark()
    with LoadGenerator() as generator:
        idle = generator.run(one_client(stack.proxy_port, stack.image, IDLE_S))
        with Drippers(stack.proxy_port, {"body": connections}, interval_s=INTERVAL_S, body_length=BODY_LENGTH,
                      body_first=BODY_FIRST, sources={"body": sources}) as drip:
            time.sleep(INTERVAL_S)  # every slot connected and refused (or held) once before the measure
            during = generator.run(one_client(stack.proxy_port, stack.image, ATTACK_S))
    entries = stack.log_since(mark)
    attackers = [e for e in entries if e["client"] in sources]
    refused = [e for e in attackers if e["status"] == 503]
    bodies = drip.of("body")
    held = Counter(c.source for c in bodies if c.how == "open at the end")
    idle_ok = [t for t, e in zip(idle.latencies, idle.errors, strict=True) if not e]
    during_ok = [t for t, e in zip(during.latencies, during.errors, strict=True) if not e]
    idle_p99, during_p99 = percentile(idle_ok, 99), percentile(during_ok, 99)
    held_total = sum(held.values())

    scenario = f"a slow uploads, {connections} from {addresses} addresses"
    figures.add(scenario, "well-behaved client p99: idle -> under attack (ratio)",
                f"{idle_p99 * 1000:.0f} -> {during_p99 * 1000:.0f} ms ({during_p99 / idle_p99:.2f}x; "
                f"{len(during_ok)} answered, errors {errors(during) or 'none'})")
    figures.add(scenario, f"held by nginx at the end (limit_conn {per_client} per address)",
                f"{held_total} ({', '.join(f'{a}: {n}' for a, n in sorted(held.items()))})")
    figures.add(scenario, "refused 503 client_limit (access log) / reached gunicorn",
                f"{sum(e['refusal'] == 'client_limit' for e in refused)} / "
                f"{sum(bool(e['upstream']) for e in attackers)}")

    # The well-behaved client: every upload answered, and its tail no worse than twice its idle tail.
    assert not errors(idle) and not errors(during), (errors(idle), errors(during))
    assert during_p99 <= 2 * idle_p99, f"p99 {during_p99 * 1000:.0f} ms under attack, {idle_p99 * 1000:.0f} ms idle"
    # nginx holds at most limit_conn of each address and refuses the rest at once, in the contract's shape.
    assert all(n <= per_client for n in held.values()), held
    if connections > addresses * per_client:
        assert refused, "more slow uploads per address than limit_conn, and none was refused"
    assert all(e["refusal"] == "client_limit" and e["retry_after"] for e in refused), refused[:3]
    refused_bodies = [c for c in bodies if c.status == 503]
    assert all(b'"overloaded"' in c.answer and b"Retry-After" in c.answer for c in refused_bodies), refused_bodies[:1]
    # No dripped upload ever reached gunicorn: they count against no budget but their address's.
    assert attackers and not [e for e in attackers if e["upstream"]], [e for e in attackers if e["upstream"]][:3]
    # Every refusal nginx logged is in the shim's /metrics (nginx's access log, counted by app/proxy_log.py).
    logged = Counter((e["path"], str(e["status"]), e["refusal"]) for e in entries if e["path"] == "/predict")
    key = ("/predict", "503", "client_limit")

    def counted() -> float:
        return stack.proxy_counts().get(key, 0.0) - counts_before.get(key, 0.0)

    wait_until(lambda: counted() >= logged[key], 10, f"{logged[key]} client_limit refusals in /metrics")
    assert counted() == logged[key], (counted(), logged[key])


def test_a_slow_upload_costs_nginx_at_most_its_body_buffer(healthy: Stack, figures: Figures,
                                                          tmp_path: Path) -> None:
    """512 uploads from 16 addresses, each with its body buffer filled and then silent (within
    client_body_timeout), on a fresh nginx in front of the same shim: its private memory grows by at most
    the buffer and the connection's own per upload (docs/proxy.md's bound: worker_connections of them)."""
    stack = healthy
    buffer_kib = int(stack.directive("client_body_buffer_size").removesuffix("k"))
    count, sources = 512, [f"127.0.3.{i}" for i in range(1, 17)]  # 32 each: limit_conn holds them all
    front = proxy.Proxy(tmp_path / "nginx", f"127.0.0.1:{stack.shim_port}", settings=stack.settings).wait()
    try:
        before = stack.nginx_private_kib(front)
        with Drippers(front.port, {"body": count}, interval_s=INTERVAL_S, body_length=BODY_LENGTH,
                      body_first=BODY_FIRST, sources={"body": sources}) as drip:
            time.sleep(2 * INTERVAL_S)  # every upload connected and its first 64 KiB read
            ended = list(drip.connections)  # a connection is recorded when it ends: none should have
            during = stack.nginx_private_kib(front)
    finally:
        front.stop()
    per_upload = (during - before) / count
    figures.add("a slow uploads, nginx memory", f"{count} uploads of {BODY_FIRST // 1024} KiB then silent, "
                "fresh nginx: private memory before -> during (per upload)",
                f"{before} -> {during} KiB ({per_upload:.1f} KiB; client_body_buffer_size {buffer_kib} KiB)")
    assert not ended, f"{len(ended)} uploads were closed or refused before the measure: {ended[:2]}"
    assert buffer_kib * 0.5 <= per_upload <= buffer_kib + CONNECTION_KIB, per_upload
