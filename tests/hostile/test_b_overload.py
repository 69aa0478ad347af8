"""(b) Overload: 256 keep-alive connections sending /predict as fast as they are answered, for 20 s, through
nginx, while probes poll /healthz and /readyz every 0.5 s. Twice: from one address (nginx's limit per
address is the bound that refuses) and spread over 8 addresses (nginx's limit in all, the shim's capacity,
refuses; the shim's own admission control refuses what an uneven share gives one of its workers). Then,
for the record, the same flood straight at gunicorn, as `make run` serves it.

Where the times come from. The flood generator (bench/loadgen.py, one Python process) shares this machine's
two cores with nginx, gunicorn and Triton and uses about one of them by itself, so what it measures includes
its own scheduling delays. The outcomes are therefore asserted on what the server did, from nginx's access
log: for nginx's own refusals, $request_time at the edge (too many of one address: refused before the body
is read) or the time in the admission server (the budget spent: refused once the body is complete, what the
client took to send it being the client's), and gunicorn's own time for what it answered (the upload was
already buffered by nginx, so a client slow to send it is not counted against the shim). The generator's own
figures are printed beside them. Health probes are asserted as their clients saw them.

How fast a refusal is. The edge refuses what one address has over its limit as soon as the head is read, in
the same turn of nginx's event loop: within REFUSAL_S. The budget is refused by the admission server, once the
body is complete and has crossed the unix socket from the edge: a few more turns of the loops that the flood
keeps busy (p50 11-14 ms, p99 190-290 ms over three runs here, 2,500-3,000 refusals a second). Its refusals
must be fast when typical (p50 within REFUSAL_S) and never cost more than serving, percentile for percentile:
p99 within the p99 of what gunicorn answered in the same window. (Against the served p50 instead, the bound
until 2026-12-06, it failed 2 runs of 4 on a machine twice as slow: refusals p99 272-352 ms, p90 78-98, against
a served p50 of 318-369 ms and p99 of 836-894; both tails are turns of loops that the same flood keeps busy. The
p90 within the served p50 held with fp32 (105 against 489 ms) and failed with the encoded transport, whose serving
is faster while its refusals are not: 199 against 183 ms.)

What bounds an accepted request's latency. Each gunicorn worker holds at most SHIM_MAX_PENDING /predict
requests (decoding, waiting for their CPU turn in arrival order, or waiting for Triton) and refuses one more
at once with 503 + Retry-After; nginx lets at most PROXY_MAX_INFLIGHT (= SHIM_MAX_PENDING: one worker can hold
them all, however unevenly the kernel spreads nginx's connections over the workers) requests in, and at most 32
of one address, and refuses the rest itself, in the same shape, so that behind nginx the shim refuses none. So at most
L = min(workers x SHIM_MAX_PENDING, PROXY_MAX_INFLIGHT, addresses x 32) accepted requests are in the shim at
any time, and they leave at X, the accepted requests per second measured over the same window (1 / X is the
per-request service time under this load; workers / X per worker). Little's law then bounds the mean time an
accepted request spends: mean <= L / X, plus what happens outside the bounded queue (gunicorn parsing the
request before admission): asserted as mean <= 1.5 L / X + 0.05 s. A worker serves its queue in arrival
order, so a request admitted last waits for at most the L - 1 admitted before it, while the other worker
serves about as many again. The tail is therefore counted in service turns, not seconds: how many accepted
requests the shim completed while this one was in it, so that a second in which the machine's other jobs take
the CPU (the flood's refusals, the generator, a shared CI machine's neighbours) stretches no bound. Measured
here: p99 1.8 L (one address) and 2.5 L (eight) in turns, 2.2 and 2.9 L / X in seconds; one CI run had 3.7
and 3.3 L / X in seconds. What spreads it past 2 L: the kernel hands nginx's connections to the two workers
unevenly, and the GIL wakes a worker's threads in no particular order. Asserted: p99 <= 4 L turns. Unbounded,
a request would wait for all 256 connections' requests (a mean of 256 turns, a p99 of 2-4 times that), and
the issue measured a p99 of 11.8 s.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

import pytest

from bench.loadgen import Job, LoadGenerator, Outcome, multipart_request
from tests.hostile.clients import HOST, HealthPoller, percentile, predict
from tests.hostile.conftest import Figures, Stack

CONNECTIONS = 256
FLOOD_SOURCES = tuple(f"127.0.1.{i}" for i in range(1, 9))  # 8 addresses x 32 connections
FLOOD_S = float(os.environ.get("HOSTILE_FLOOD_S", "20"))
WARMUP_S = 2.0
REFUSAL_S = 0.1  # the bound on a refusal


def by_error(outcome: Outcome, error: str) -> list[float]:
    return [t for t, e in zip(outcome.latencies, outcome.errors, strict=True) if e == error]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def turns_waited(log: list[dict[str, Any]], window: list[dict[str, Any]]) -> list[int]:
    """For each request of `window` that the shim answered 200: how many requests the shim answered 200
    (inside the window or not) while it was in the shim, by gunicorn's time (ends from nginx's $msec)."""
    ends = sorted(float(e["time_unix"]) for e in log if e["path"] == "/predict" and e["status"] == 200)
    turns = []
    for e in window:
        if e["status"] == 200:
            end = float(e["time_unix"])
            turns.append(bisect.bisect_left(ends, end) - bisect.bisect_right(ends, end - float(e["upstream_time_s"])))
    return turns


@pytest.mark.parametrize("addresses", [1, len(FLOOD_SOURCES)], ids=["one-address", "eight-addresses"])
def test_a_flood_is_refused_fast_and_health_stays_fast(healthy: Stack, figures: Figures, addresses: int) -> None:
    stack = healthy
    sources = () if addresses == 1 else FLOOD_SOURCES
    settings = stack.settings
    limits = stack.predict_limits()
    per_client, in_all = limits["shim_predict_per_client"], limits["shim_predict_total"]
    upload = multipart_request(HOST, stack.proxy_port, "/predict", "image", "test.jpg", "image/jpeg", stack.image)
    with LoadGenerator() as generator:
        alone = generator.run(Job(HOST, stack.proxy_port, (upload,), expect=b'"predictions"', concurrency=1,
                                  warmup_s=1.0, duration_s=4.0))
        mark = stack.log_mark()
        # one prober per path, as a kubelet probes, every 0.1 s: over 100 answers, so that the p99 is not the max
        with HealthPoller(stack.proxy_port, interval_s=0.1) as health:
            opened = time.time() + WARMUP_S
            flood = generator.run(Job(HOST, stack.proxy_port, (upload,), expect=b'"predictions"',
                                      concurrency=CONNECTIONS, warmup_s=WARMUP_S, duration_s=FLOOD_S, timeout_s=30,
                                      sources=sources))
            closed = time.time()
            sample = predict(stack.proxy_port, stack.image)  # one more request, read whole: headers and body
    # The server's side: /predict requests that started within the measured window. nginx's own refusals are
    # timed from the moment nginx could refuse them (the edge's: $request_time; the admission server's: its own
    # time, the body being complete); what gunicorn answered by its own time (the upload was already buffered
    # by nginx, so a client slow to send it is not counted against the shim).
    window = [e for e in stack.log_since(mark) if e["path"] == "/predict"
              and opened <= float(e["time_unix"]) - float(e["request_time_s"]) and float(e["time_unix"]) <= closed]
    accepted = [float(e["upstream_time_s"]) for e in window if e["status"] == 200]
    turns = turns_waited(stack.log_since(mark), window)
    refused = [e for e in window if e["status"] == 503]
    by_edge = [float(e["request_time_s"]) for e in refused if not e["upstream"] and e["refusal"] != "overloaded"]
    by_admission = [float(e["admission_time_s"]) for e in refused if e["refusal"] == "overloaded"]
    by_nginx = by_edge + by_admission
    by_shim = [float(e["upstream_time_s"]) for e in refused if e["upstream"]]
    other = sorted({e["status"] for e in window} - {200, 503})
    rate = len(accepted) / (closed - opened)
    in_shim = min(settings.workers * settings.max_pending, in_all, addresses * per_client)
    queue_s = in_shim / rate if rate else float("inf")
    mean = sum(accepted) / len(accepted) if accepted else float("inf")

    scenario = f"b flood (nginx), {addresses} address{'es' if addresses > 1 else ''}"
    figures.add(scenario, "connections / window", f"{CONNECTIONS} / {closed - opened:.0f} s")
    figures.add(scenario, "one client alone: p50 (client side)", ms(percentile(alone.latencies, 50)))
    figures.add(scenario, "accepted: X per second; mean, p50, p99 (server side)",
                f"{rate:.1f}/s; {ms(mean)}, {ms(percentile(accepted, 50))}, {ms(percentile(accepted, 99))}")
    figures.add(scenario, f"queue bound L/X, L = min({settings.workers} workers x {settings.max_pending} pending, "
                f"{in_all} in all, {addresses} x {per_client})",
                f"{ms(queue_s)} (mean bound {ms(1.5 * queue_s + 0.05)})")
    figures.add(scenario, "accepted: requests the shim completed during each one's stay, p50 / p99 (bound 4 L)",
                f"{percentile(turns, 50):.0f} / {percentile(turns, 99):.0f} ({4 * in_shim})")
    figures.add(scenario, f"refused by nginx (limit_conn {in_all} in all, {per_client} per address): count, p50, "
                "p99 (server side)",
                f"{len(by_nginx)}, {ms(percentile(by_nginx, 50))}, {ms(percentile(by_nginx, 99))}")
    figures.add(scenario, "of which: the edge (32 per address): count, p50, p99; the admission server (the budget): "
                "count, p50, p90, p99",
                f"{len(by_edge)}, {ms(percentile(by_edge, 50))}, {ms(percentile(by_edge, 99))}; {len(by_admission)}, "
                f"{ms(percentile(by_admission, 50))}, {ms(percentile(by_admission, 90))}, "
                f"{ms(percentile(by_admission, 99))}")
    figures.add(scenario, f"refused by the shim (SHIM_MAX_PENDING {settings.max_pending}): count, p50, p99 "
                "(server side)", f"{len(by_shim)}, {ms(percentile(by_shim, 50))}, {ms(percentile(by_shim, 99))}")
    figures.add(scenario, "client side: accepted p99 / refused p99 / errors besides 503",
                f"{ms(percentile(by_error(flood, ''), 99))} / {ms(percentile(by_error(flood, 'HTTP 503'), 99))} / "
                f"{sorted({e for e in flood.errors if e and e != 'HTTP 503'}) or 'none'}")
    for path in ("/healthz", "/readyz"):
        figures.add(scenario, f"{path} p99 / max", f"{ms(percentile(health.latencies(path), 99))} / "
                    f"{ms(max(health.latencies(path)))} ({len(health.latencies(path))} polls, "
                    f"{len(health.failures(path))} not 200)")

    assert accepted, "no request was served during the flood"
    assert not other, f"answers besides 200 and 503: {other}"
    assert by_nginx, f"nginx refused nothing of {CONNECTIONS} connections"
    for path in ("/healthz", "/readyz"):
        assert not health.failures(path), [(a.status, a.error, round(a.seconds, 2)) for a in health.failures(path)]
        assert percentile(health.latencies(path), 99) < 1.0, path
    assert all(e["retry_after"] for e in refused), [e for e in refused if not e["retry_after"]][:3]
    if sample.status == 503:
        assert sample.headers["retry-after"] and sample.json_error() in {"overloaded", "backend_unavailable"}
    for layer, times in [("the edge's", by_edge), ("the shim's", by_shim)]:
        assert not times or percentile(times, 99) < REFUSAL_S, f"{layer} refusals: p99 {ms(percentile(times, 99))}"
    if by_admission:
        typical = percentile(by_admission, 50)
        assert typical < REFUSAL_S, f"the budget's refusals: p50 {ms(typical)}"
        assert percentile(by_admission, 99) <= percentile(accepted, 99), (
            f"the budget's refusals: p99 {ms(percentile(by_admission, 99))}, more than serving "
            f"(p99 {ms(percentile(accepted, 99))})")
    assert mean <= 1.5 * queue_s + 0.05, f"accepted mean {ms(mean)}: more than the queue explains ({ms(queue_s)})"
    assert percentile(turns, 99) <= 4 * in_shim, (
        f"accepted p99: {percentile(turns, 99):.0f} requests completed during its stay, more than 4 x {in_shim} "
        f"the queue explains (p99 {ms(percentile(accepted, 99))}, L/X {ms(queue_s)})")


def test_without_the_proxy_a_flood_for_the_record(healthy: Stack, figures: Figures) -> None:
    """Not asserted: the same 256 connections straight at gunicorn (as `make run` serves), to show what the
    shim's own admission control does alone. Only recovery is checked."""
    from devstack.waiting import wait_for_http

    stack = healthy
    upload = multipart_request(HOST, stack.shim_port, "/predict", "image", "test.jpg", "image/jpeg", stack.image)
    with LoadGenerator() as generator, HealthPoller(stack.shim_port, interval_s=0.5, timeout_s=5) as health:
        flood = generator.run(Job(HOST, stack.shim_port, (upload,), expect=b'"predictions"', concurrency=CONNECTIONS,
                                  warmup_s=WARMUP_S, duration_s=FLOOD_S, timeout_s=30))
    accepted, refused = by_error(flood, ""), by_error(flood, "HTTP 503")
    scenario = "b flood (no proxy)"
    figures.add(scenario, "accepted: per second, p50, p99 (client side)",
                f"{len(accepted) / flood.window_s:.1f}/s, {ms(percentile(accepted, 50))}, "
                f"{ms(percentile(accepted, 99))}")
    figures.add(scenario, "refused 503: count, p50, p99 (client side)",
                f"{len(refused)}, {ms(percentile(refused, 50))}, {ms(percentile(refused, 99))}")
    figures.add(scenario, "errors besides 503", sorted({e for e in flood.errors if e and e != "HTTP 503"}) or "none")
    for path in ("/healthz", "/readyz"):
        figures.add(scenario, f"{path} p99 / max", f"{ms(percentile(health.latencies(path), 99))} / "
                    f"{ms(max(health.latencies(path)))} ({len(health.failures(path))} not 200 within 5 s)")
    wait_for_http(f"http://127.0.0.1:{stack.shim_port}/readyz", 60, what="gunicorn to answer after the flood")
