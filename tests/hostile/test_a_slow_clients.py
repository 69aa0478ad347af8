"""(a) Slow clients: 64 connections dripping request heads and 64 dripping bodies, one byte every 3 s, plus 8
bodies that stall half way, for 60 s (each reconnecting whenever it is closed), while normal clients send
/predict and probes poll /healthz and /readyz every 0.5 s; then dripped heads straight at gunicorn, for the
record, as `make run` serves without a proxy: the same 64, and more than gunicorn has threads."""

from __future__ import annotations

import os

from bench.loadgen import Job, LoadGenerator, Outcome, multipart_request
from devstack.waiting import wait_for_http
from tests.hostile.clients import ATTACKERS, HOST, Drippers, HealthPoller, percentile
from tests.hostile.conftest import Figures, Stack

DRIP_S = float(os.environ.get("HOSTILE_DRIP_S", "60"))  # the minute; shorter only to develop the suite
DIRECT_DRIP_S = float(os.environ.get("HOSTILE_DIRECT_DRIP_S", "15"))
INTERVAL_S = 3.0
DRIPPERS = {"headers": 64, "body": 64, "stalled": 8}
NORMAL_CLIENTS = 4
IDLE_S = 8.0
MARGIN_S = 3.0  # a closed connection is seen by the dripper up to one drip interval late


def normal_clients(port: int, image: bytes, duration_s: float, timeout_s: float = 30) -> Job:
    upload = multipart_request(HOST, port, "/predict", "image", "test.jpg", "image/jpeg", image)
    return Job(HOST, port, (upload,), expect=b'"predictions"', concurrency=NORMAL_CLIENTS, warmup_s=1.0,
               duration_s=duration_s, timeout_s=timeout_s)


def answered(outcome: Outcome) -> list[float]:
    return [t for t, e in zip(outcome.latencies, outcome.errors, strict=True) if not e]


def errors(outcome: Outcome) -> dict[str, int]:
    found: dict[str, int] = {}
    for e in outcome.errors:
        if e:
            found[e] = found.get(e, 0) + 1
    return found


def test_slow_clients_through_nginx_stop_no_one(healthy: Stack, figures: Figures) -> None:
    stack = healthy
    header_timeout = stack.seconds("client_header_timeout")
    body_timeout = stack.seconds("client_body_timeout")
    per_client = stack.predict_limits()["shim_predict_per_client"]
    log_mark = stack.log_mark()
    with LoadGenerator() as generator:
        idle = generator.run(normal_clients(stack.proxy_port, stack.image, IDLE_S))
        with Drippers(stack.proxy_port, DRIPPERS, interval_s=INTERVAL_S) as drip, \
                HealthPoller(stack.proxy_port, interval_s=0.5) as health:
            during = generator.run(normal_clients(stack.proxy_port, stack.image, DRIP_S - 1.0))
    idle_p99, during_p99 = percentile(answered(idle), 99), percentile(answered(during), 99)
    heads, bodies, stalled = drip.of("headers"), drip.of("body"), drip.of("stalled")
    head_closed = [c for c in heads if c.how in ("closed", "answered")]
    stalled_closed = [c for c in stalled if c.how in ("closed", "answered")]
    refused = [c for c in bodies if c.status == 503]
    held = [c for c in bodies if c.how == "open at the end"]
    scenario = "a slow clients (nginx)"
    figures.add(scenario, f"normal clients ({NORMAL_CLIENTS}) p99 idle -> while dripping",
                f"{idle_p99 * 1000:.0f} -> {during_p99 * 1000:.0f} ms ({len(answered(during))} answered, "
                f"errors {errors(during) or 'none'})")
    for path in ("/healthz", "/readyz"):
        latencies = health.latencies(path)
        figures.add(scenario, f"{path} p99 / max while dripping",
                    f"{percentile(latencies, 99) * 1000:.0f} / {max(latencies) * 1000:.0f} ms "
                    f"({len(latencies)} polls, {len(health.failures(path))} not 200)")
    figures.add(scenario, f"dripped heads: closed by nginx after (client_header_timeout {header_timeout:g} s)",
                f"{min((c.lifetime for c in head_closed), default=0):.1f}-"
                f"{max((c.lifetime for c in head_closed), default=0):.1f} s ({len(head_closed)} connections)")
    figures.add(scenario, f"stalled bodies: closed after silence of (client_body_timeout {body_timeout:g} s)",
                f"{min((c.silent_for for c in stalled_closed), default=0):.1f}-"
                f"{max((c.silent_for for c in stalled_closed), default=0):.1f} s ({len(stalled_closed)} connections)")
    figures.add(scenario, f"dripped bodies from one address (limit_conn {per_client})",
                f"{len(held)} held by nginx for the whole {DRIP_S:.0f} s (a byte every {INTERVAL_S:g} s resets "
                f"client_body_timeout), {len(refused)} refusals 503 overloaded")

    # Normal clients: every request answered, and hardly slower.
    assert not errors(idle) and not errors(during), (errors(idle), errors(during))
    assert during_p99 <= 2 * idle_p99, f"p99 {during_p99 * 1000:.0f} ms while dripping, {idle_p99 * 1000:.0f} ms idle"
    # Health: every poll answered 200 in under a second.
    for path in ("/healthz", "/readyz"):
        assert not health.failures(path), [(a.status, a.error, round(a.seconds, 2)) for a in health.failures(path)]
        assert percentile(health.latencies(path), 99) < 1.0 and max(health.latencies(path)) < 1.0, path
    # Dripped heads: nginx closes each when client_header_timeout is up (counted from the connection's start).
    assert head_closed, "no dripped head was closed"
    for c in head_closed:
        assert header_timeout - 1 <= c.lifetime <= header_timeout + MARGIN_S, (c.lifetime, c.how, c.answer[:80])
    assert all(c.lifetime <= header_timeout + MARGIN_S for c in heads if c.how == "open at the end")
    # Stalled bodies: closed once nothing arrived for client_body_timeout.
    assert stalled_closed, "no stalled body was closed"
    for c in stalled_closed:
        assert body_timeout - 1 <= c.silent_for <= body_timeout + MARGIN_S, (c.silent_for, c.how)
    # Dripped bodies: nginx holds at most limit_conn of one address and refuses the others with the contract's
    # 503; a body that keeps trickling is never closed by a timeout (client_body_timeout is per read), but it
    # costs nginx a connection, never a gunicorn thread.
    assert len(held) <= per_client, f"{len(held)} dripped bodies held from one address, limit_conn is {per_client}"
    assert all(b'"overloaded"' in c.answer and b"Retry-After" in c.answer for c in refused), refused[:1]
    # Nothing of the attackers reached gunicorn.
    attackers = set(ATTACKERS.values())
    logged = [e for e in stack.log_since(log_mark) if e["client"] in attackers]
    assert logged and not [e for e in logged if e["upstream"]], [e for e in logged if e["upstream"]][:3]



def test_without_the_proxy_dripped_heads_hold_gunicorns_threads_for_the_record(healthy: Stack,
                                                                               figures: Figures) -> None:
    """Not asserted: dripped heads straight at gunicorn (as `make run` serves), to show what the proxy is for:
    the same 64, then more than the workers have threads. Only recovery is checked: once the slow clients
    leave, gunicorn answers again."""
    stack = healthy
    threads = stack.settings.workers * stack.settings.threads
    for count in sorted({64, threads + 16}):
        with LoadGenerator() as generator, Drippers(stack.shim_port, {"headers": count}, interval_s=INTERVAL_S) \
                as drip, HealthPoller(stack.shim_port, interval_s=0.5, timeout_s=2.0) as health:
            during = generator.run(normal_clients(stack.shim_port, stack.image, DIRECT_DRIP_S, timeout_s=5.0))
        scenario = f"a slow clients (no proxy), {count} heads ({threads} threads in all)"
        done = answered(during)
        figures.add(scenario, f"normal clients ({NORMAL_CLIENTS}, 5 s timeout) for {DIRECT_DRIP_S:.0f} s",
                    f"{len(done)} answered (p99 {percentile(done, 99) * 1000:.0f} ms), "
                    f"errors {errors(during) or 'none'}")
        for path in ("/healthz", "/readyz"):
            figures.add(scenario, f"{path} answered within 2 s",
                        f"{len(health.answers[path]) - len(health.failures(path))} of {len(health.answers[path])}")
        heads = drip.of("headers")
        figures.add(scenario, "dripped heads closed by gunicorn",
                    f"{sum(c.how != 'open at the end' for c in heads)} of {len(heads)} "
                    f"(longest open {max(c.lifetime for c in heads):.0f} s)")
        wait_for_http(f"http://127.0.0.1:{stack.shim_port}/readyz", 60,
                      what="gunicorn to answer once the drippers left")
