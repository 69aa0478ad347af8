"""(e) Every route the proxy serves, not only /predict (issue 26): uploads dripped one byte at a time to the
other paths, from one address, from many, and from one address shared with a well-behaved client (every
client behind one ingress); then nginx's memory at its connection limit with four 8 KB headers per request.

What must hold: the well-behaved client's /predict answered 200 throughout, its p99 within 2x of idle
(measured side by side); no dripped request to another path reaches gunicorn, none is held, and nothing of
theirs lands in client_body_temp; what one address holds stays within the limit_conn values of the rendered
configuration; nginx's peak memory at the limit is under the proxy container's limit in deploy/k8s/shim.yaml."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.loadgen import Job, LoadGenerator, Outcome, multipart_request
from devstack import proxy
from tests.deploy_support import yaml_docs
from tests.hostile.clients import HOST, NORMAL, Drippers, percentile
from tests.hostile.conftest import Figures, Stack, worker_pids
from tests.support import ROOT

ATTACK_S = float(os.environ.get("HOSTILE_ROUTES_S", "15"))
IDLE_S = 5.0
# Every path but /predict: those gunicorn serves publicly, those it must not (404 at nginx), and one that is
# nobody's.
OTHER_ROUTES = ("/healthz", "/readyz", "/openapi.json", "/metrics", "/traffic", "/admin/traffic", "/x",
                "/proxy-healthz")
UPLOAD = 400_000  # a dripped /predict upload: over the edge's 256 KiB body buffer, the rest to a temporary file
DECLARED = 16_000_000  # the Content-Length: just under the 16 MiB upload limit of /predict


def one_client(port: int, image: bytes, duration_s: float, source: str = NORMAL) -> Job:
    upload = multipart_request(HOST, port, "/predict", "image", "test.jpg", "image/jpeg", image)
    return Job(HOST, port, (upload,), expect=b'"predictions"', concurrency=1, warmup_s=1.0, duration_s=duration_s,
               timeout_s=30, sources=(source,))


def answered(outcome: Outcome) -> list[float]:
    return [t for t, e in zip(outcome.latencies, outcome.errors, strict=True) if not e]


def errors(outcome: Outcome) -> dict[str, int]:
    return dict(Counter(e for e in outcome.errors if e))


def temp_bytes(front: proxy.Proxy) -> int:
    """The bytes of client_body_temp that nginx's processes hold open. nginx unlinks a temporary file as soon as
    it creates it, so the folder always looks empty: the files are found through /proc/<pid>/fd."""
    total = 0
    for pid in [front.process.pid, *worker_pids(front.process.pid)]:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if "/client_body/" in os.readlink(fd):
                        total += fd.stat().st_size
    return total


@contextlib.contextmanager
def peak_of(front: proxy.Proxy, interval_s: float = 0.5) -> Iterator[list[int]]:
    """The most client_body_temp that nginx held while the block ran (sampled every interval_s)."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], temp_bytes(front))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join(timeout=5)


def attack(stack: Stack, figures: Figures, scenario: str, *, drippers: int, sources: Sequence[str],
           paths: Sequence[str], client: str = NORMAL, body_length: int = DECLARED, body_first: int = 0,
           interval_s: float = 1.0) -> tuple[Drippers, list[dict[str, object]], int]:
    """The well-behaved client from `client`, idle then under `drippers` slow uploads; its figures added and
    checked. Returns the drippers, what nginx logged of the attackers, and client_body_temp's peak."""
    mark = stack.log_mark()
    with LoadGenerator() as generator:
        idle = generator.run(one_client(stack.proxy_port, stack.image, IDLE_S, client))
        with peak_of(stack.proxy) as temp, \
                Drippers(stack.proxy_port, {"body": drippers}, interval_s=interval_s, body_length=body_length,
                         body_first=body_first, sources={"body": sources}, paths=paths) as drip:
            time.sleep(interval_s)  # every slot connected (and refused, or held) once before the measure
            during = generator.run(one_client(stack.proxy_port, stack.image, ATTACK_S, client))
    attackers = [e for e in stack.log_since(mark) if e["client"] in sources and not
                 (e["path"] == "/predict" and e["status"] == 200 and client in sources)]
    idle_p99, during_p99 = percentile(answered(idle), 99), percentile(answered(during), 99)
    figures.add(scenario, "well-behaved client p99: idle -> under attack (ratio)",
                f"{idle_p99 * 1000:.0f} -> {during_p99 * 1000:.0f} ms ({during_p99 / idle_p99:.2f}x; "
                f"{len(answered(during))} answered, errors {errors(during) or 'none'})")
    figures.add(scenario, "client_body_temp at its peak", f"{temp[0]} bytes")
    assert not errors(idle) and not errors(during), (errors(idle), errors(during))
    assert during_p99 <= 2 * idle_p99, f"p99 {during_p99 * 1000:.0f} ms under attack, {idle_p99 * 1000:.0f} ms idle"
    return drip, attackers, temp[0]


def check_other_routes_refused(drip: Drippers, attackers: list[dict[str, object]], figures: Figures,
                               scenario: str) -> None:
    # Those still open when the attack stopped had only just connected (each reconnects a second after its 413).
    assert all(c.lifetime < 2 for c in drip.of("body") if c.path != "/predict" and c.how == "open at the end")
    others = [c for c in drip.of("body") if c.path != "/predict" and c.how != "open at the end"]
    statuses = Counter((c.path, c.status) for c in others)
    figures.add(scenario, "dripped uploads to other paths: answers (path, status) x count",
                ", ".join(f"{p} {s}: {n}" for (p, s), n in sorted(statuses.items(), key=str)))
    # Refused at once, before a byte of the body, in the contract's shape; never held, never passed on.
    assert others and all(c.status == 413 and b'"too_large"' in c.answer for c in others), statuses
    assert all(c.lifetime < 5 for c in others), max(others, key=lambda c: c.lifetime)
    logged = [e for e in attackers if e["path"] != "/predict"]
    assert logged and all(e["status"] == 413 and e["refusal"] == "too_large" for e in logged), logged[:3]
    assert not [e for e in logged if e["upstream"]], [e for e in logged if e["upstream"]][:3]


def test_uploads_dripped_to_every_other_route_from_one_address_deny_no_one(healthy: Stack,
                                                                          figures: Figures) -> None:
    """The issue's attack: 128 connections from one address, each a POST to a path other than /predict with a
    16 MB Content-Length, dripped one byte at a time."""
    scenario = "e 128 dripped 16 MB uploads to other paths, one address"
    drip, attackers, temp = attack(healthy, figures, scenario, drippers=128, sources=["127.0.4.1"],
                                   paths=OTHER_ROUTES)
    check_other_routes_refused(drip, attackers, figures, scenario)
    assert temp <= len(healthy.image), f"{temp} bytes in client_body_temp: the attackers' bodies were stored"


def test_every_route_dripped_from_many_addresses_stays_within_each_addresss_limits(healthy: Stack,
                                                                                   figures: Figures) -> None:
    """256 slow uploads over 8 addresses, half to /predict (400 KB, the first 256 KiB at once, then a byte every
    3 s), half to every other path (16 MB declared)."""
    stack = healthy
    limits = stack.predict_limits()
    per_address = int(stack.directive("limit_conn", "reset_timedout_connection").split()[1])
    sources = [f"127.0.5.{i}" for i in range(1, 9)]
    paths = [p for other in OTHER_ROUTES for p in ("/predict", other)]
    scenario = "e 256 slow uploads over every path, 8 addresses"
    drip, attackers, temp = attack(stack, figures, scenario, drippers=256, sources=sources, paths=paths,
                                   body_length=UPLOAD, body_first=256 * 1024, interval_s=3.0)
    check_other_routes_refused(drip, attackers, figures, scenario)
    held = Counter(c.source for c in drip.of("body") if c.how == "open at the end")
    held_predict = Counter(c.source for c in drip.of("body") if c.how == "open at the end" and c.path == "/predict")
    figures.add(scenario, f"held at the end per address (limit_conn {per_address}; /predict "
                f"{limits['shim_predict_per_client']})", f"max {max(held.values(), default=0)}, "
                f"/predict max {max(held_predict.values(), default=0)}, in all {sum(held.values())}")
    bound = limits["shim_edge_predict"] * UPLOAD  # these uploads' size; the bound at the limit is x 16 MiB
    figures.add(scenario, "client_body_temp bound (held /predict x their size)",
                f"{temp} <= {sum(held_predict.values()) * UPLOAD} bytes")
    assert all(n <= per_address for n in held.values()), held
    assert all(n <= limits["shim_predict_per_client"] for n in held_predict.values()), held_predict
    assert temp <= min(bound, sum(held_predict.values()) * UPLOAD + len(stack.image)), temp
    assert not [e for e in attackers if e["upstream"]], [e for e in attackers if e["upstream"]][:3]


def test_behind_one_shared_address_other_routes_cannot_take_the_predict_of_that_address(healthy: Stack,
                                                                                      figures: Figures) -> None:
    """Every client behind one ingress (no PROXY_TRUSTED_ADDRESSES): the attacker and the well-behaved client
    share 127.0.6.1. 128 dripped 16 MB uploads to other paths hold none of that address's requests."""
    scenario = "e 128 dripped uploads to other paths, the client's own address"
    drip, attackers, _ = attack(healthy, figures, scenario, drippers=128, sources=["127.0.6.1"],
                                paths=OTHER_ROUTES, client="127.0.6.1")
    check_other_routes_refused(drip, attackers, figures, scenario)


# --- memory at the connection limit ------------------------------------------------------------------------

HEADER_BYTES = 8000  # four of them per request: each in one of large_client_header_buffers' 8 KiB buffers


def big_head(index: int) -> bytes:
    """A request head with four 8 KB headers, without the empty line that would end it."""
    pads = "".join(f"X-Pad-{i}: {chr(97 + (index + i) % 26) * HEADER_BYTES}\r\n" for i in range(4))
    return f"GET /healthz HTTP/1.1\r\nHost: {HOST}\r\n{pads}".encode()


async def hold_heads(port: int, count: int, sources: Sequence[str], measure: threading.Event,
                     done: threading.Event) -> int:
    """`count` connections, each sending big_head() and holding; returns how many were still open when
    `measure` was set (by the caller, after it read nginx's memory: `done`)."""
    writers: list[asyncio.StreamWriter] = []
    readers: list[asyncio.StreamReader] = []

    async def one(i: int) -> None:
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection(HOST, port, local_addr=(sources[i % len(sources)], 0))
            writer.write(big_head(i))
            await writer.drain()
            writers.append(writer)
            readers.append(reader)

    await asyncio.gather(*(one(i) for i in range(count)))
    measure.set()
    while not done.is_set():
        await asyncio.sleep(0.05)
    open_now = sum(1 for r in readers if not r.at_eof())
    for writer in writers:
        writer.close()
    return open_now


def k8s_proxy_limit_mib() -> float:
    (deployment, *_) = yaml_docs(ROOT / "deploy" / "k8s" / "shim.yaml")
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "proxy"]
    match = re.fullmatch(r"(\d+)(Mi|Gi)", container["resources"]["limits"]["memory"])
    assert match
    return int(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


def test_the_proxys_peak_memory_at_its_connection_limit_is_under_its_kubernetes_limit(
        healthy: Stack, figures: Figures, tmp_path: Path) -> None:
    """A fresh nginx in front of the same shim: worker_processes x worker_connections connections less a
    margin for the listeners, each holding a head of four 8 KB headers (within client_header_timeout),
    measured; the kernel shares them unevenly between the workers, and a full worker closes the rest, so the
    cost of those held is taken per connection, times the limit. Then the /predict bodies the edge admits
    (shim_edge_predict), each with its body buffer filled and a connection's own (test_a measured it), on
    top."""
    stack = healthy
    workers, per_worker = int(stack.directive("worker_processes")), int(stack.directive("worker_connections"))
    limit = workers * per_worker
    count = limit - 96
    sources = [f"127.0.7.{i}" for i in range(1, 17)]
    front = proxy.Proxy(tmp_path / "nginx", f"127.0.0.1:{stack.shim_port}", settings=stack.settings).wait()
    measure, done = threading.Event(), threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        before = stack.nginx_private_kib(front)
        future = pool.submit(asyncio.run, hold_heads(front.port, count, sources, measure, done))
        assert measure.wait(timeout=stack.seconds("client_header_timeout") - 2), "the heads took too long to send"
        time.sleep(1.0)  # nginx reads what is in flight
        during = stack.nginx_private_kib(front)
        done.set()
        held = future.result(timeout=30)
    finally:
        done.set()
        pool.shutdown(wait=True)
        front.stop()
    per_connection = (during - before) / max(held, 1)
    buffer_kib = int(stack.directive("client_body_buffer_size").removesuffix("k"))
    bodies = stack.predict_limits()["shim_edge_predict"]
    peak_mib = (before + per_connection * limit + bodies * (buffer_kib + 16)) / 1024
    k8s = k8s_proxy_limit_mib()
    figures.add("e nginx memory at its connection limit", f"{held} of {count} heads of 4 x 8 KB held: private "
                "memory before -> during (per connection)",
                f"{before} -> {during} KiB ({per_connection:.1f} KiB)")
    figures.add("e nginx memory at its connection limit", f"peak at {limit} connections + {bodies} body buffers "
                "(deploy/k8s limit)", f"{peak_mib:.0f} MiB ({k8s:.0f} MiB)")
    assert held >= per_worker - 96, f"only {held} of {count} connections held their head"
    assert per_connection >= 4 * HEADER_BYTES / 1024, "the header buffers were not measured"
    assert peak_mib <= k8s, f"{peak_mib:.0f} MiB at the limit, over the proxy's {k8s:.0f} MiB"
