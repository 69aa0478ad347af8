"""nginx's access log as the shim's metrics (app/proxy_log.py): what a datagram becomes, over a real UDP socket.
The whole path, nginx to a live shim's /metrics, is tested in tests/integration/test_observability.py."""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest
from prometheus_client import REGISTRY

from app import proxy_log
from app.metrics import PROXY_PATHS, PROXY_REASONS
from devstack.waiting import wait_until


def line(status: object, path: str = "/predict", refusal: str = "") -> bytes:
    """A datagram as nginx sends it (syslog, tag=nginx, nohostname, log_format shim_metrics)."""
    entry = json.dumps({"status": status, "path": path, "refusal": refusal})
    return f"<190>Dec  1 09:35:44 nginx: {entry}".encode()


def count(path: str, status: str, reason: str) -> float:
    value = REGISTRY.get_sample_value("shim_proxy_responses_total", {"path": path, "status": status, "reason": reason})
    return value or 0.0


@pytest.mark.parametrize(("datagram", "labels"), [
    (line(200), ("/predict", "200", "")),
    (line(503, refusal="client_limit"), ("/predict", "503", "client_limit")),
    (line(408, path="", refusal="client_timeout"), ("other", "408", "client_timeout")),
    (line(200, path="/healthz"), ("/healthz", "200", "")),
    (line(404, path="/v2/../etc/passwd" + "x" * 500), ("other", "404", "")),  # unbounded paths are "other"
    (line(999), ("/predict", "other", "")),
    (line("200"), ("/predict", "other", "")),
    (line(503, refusal="made-up"), ("/predict", "503", "other")),
])
def test_a_datagram_becomes_bounded_labels(datagram: bytes, labels: tuple[str, str, str]) -> None:
    assert proxy_log.parse(datagram) == labels


@pytest.mark.parametrize("datagram", [b"", b"<190>Dec  1 09:35:44 nginx: not json", b"[1, 2]", b"{\"status\": 200"])
def test_what_is_not_an_access_log_line_is_none(datagram: bytes) -> None:
    assert proxy_log.parse(datagram) is None


def test_every_reason_nginx_gives_is_a_label_value() -> None:
    """The reasons of deploy/nginx/nginx.conf.template's map $shim_refusal are the ones counted as themselves."""
    from devstack.proxy import TEMPLATE

    text = TEMPLATE.read_text()
    block = text[text.index("$shim_refusal {"):text.index("}", text.index("$shim_refusal {"))]
    named = {word.strip(";") for row in block.splitlines()[1:] if row.strip() and not row.strip().startswith("#")
             for word in row.split()[1:2] if not word.startswith(("$", '"'))}
    refusals = set(re.findall(r"X-Shim-Proxy-Refusal (\w+) always", text))
    bad_request = {"invalid_body", "bad_request"}  # map $shim_bad_request
    assert named | refusals | bad_request == set(PROXY_REASONS)
    assert set(PROXY_PATHS) <= set(re.findall(r"location = (/\w+) \{", text))


def test_served_datagrams_are_counted_until_stopped() -> None:
    sock = proxy_log.bind("127.0.0.1:0")
    stop = threading.Event()
    before = count("/predict", "413", "too_large"), count("/readyz", "503", "backend_unavailable")
    counted: list[int] = []
    server = threading.Thread(target=lambda: counted.append(proxy_log.serve(sock, stop)))
    server.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sent = [line(413, refusal="too_large")] * 3 + [b"junk", line(503, "/readyz", "backend_unavailable")]
            for datagram in sent:
                sender.sendto(datagram, sock.getsockname())
        wait_until(lambda: count("/readyz", "503", "backend_unavailable") > before[1], 5, "the datagrams counted")
    finally:
        stop.set()
        server.join(timeout=5)
        sock.close()
    assert count("/predict", "413", "too_large") - before[0] == 3
    assert counted == [4]  # the junk datagram is logged, not counted


def test_initialize_makes_the_series_the_alerts_divide_by() -> None:
    proxy_log.initialize()
    for status, reason in [("200", ""), ("503", "overloaded"), ("503", "client_limit")]:
        assert REGISTRY.get_sample_value("shim_proxy_responses_total",
                                         {"path": "/predict", "status": status, "reason": reason}) is not None


def test_the_pause_between_reads_shortens_as_the_rate_grows() -> None:
    """At a few requests a second the reader wakes every GATHER_S; at a flood's rate it pauses so that about
    KEEP_UNDER datagrams wait in the socket's buffer, not more than it holds."""
    gather = proxy_log.GATHER_S
    assert proxy_log.pause(1, 5.0, gather) == gather
    assert proxy_log.pause(20, gather, gather) == gather  # 1,000/s: 20 gather
    flood = proxy_log.pause(1000, 0.02, gather)  # 50,000/s
    assert flood == pytest.approx(proxy_log.KEEP_UNDER / 50_000)
    assert 50_000 * flood <= proxy_log.KEEP_UNDER


def test_after_an_idle_socket_the_pause_starts_short_and_at_most_doubles() -> None:
    """A flood that follows quiet: the first pause is FIRST_S, not GATHER_S (at 50,000/s, 1,000 datagrams would
    arrive in 20 ms, twice what a default buffer holds; measured loss: bench/RESULTS.md), and each read's rate
    sets the next before the buffer can fill. At a steady 1,000/s it still reaches GATHER_S within five reads."""
    pauses = [proxy_log.FIRST_S]
    for _ in range(6):  # 1,000/s: what arrived during each pause
        pauses.append(proxy_log.pause(max(1, round(1000 * pauses[-1])), pauses[-1], pauses[-1]))
    assert pauses == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02])
    waits, arrived = [proxy_log.FIRST_S], []
    for _ in range(6):  # 50,000/s from the first read on
        arrived.append(round(50_000 * waits[-1]))
        waits.append(proxy_log.pause(arrived[-1], waits[-1], waits[-1]))
    assert max(arrived) <= proxy_log.KEEP_UNDER, arrived
    assert waits[-1] == pytest.approx(proxy_log.KEEP_UNDER / 50_000)
    # quiet again: a read that waited 0.5 s for its one datagram starts over, whatever the pause was
    assert proxy_log.pause(1, 0.5, proxy_log.GATHER_S, waited_s=0.5) == proxy_log.FIRST_S
    assert proxy_log.pause(8, 0.02, proxy_log.GATHER_S, waited_s=0.01) == proxy_log.GATHER_S  # 400/s: not idle


def test_bursts_are_counted_whole() -> None:
    """Bursts of 100 datagrams sent as fast as one sender can (under what a default net.core.rmem_max holds),
    ten of them: every datagram counted, many to one read."""
    sock = proxy_log.bind("127.0.0.1:0")
    stop = threading.Event()
    before = count("/healthz", "200", "")
    counted: list[int] = []
    server = threading.Thread(target=lambda: counted.append(proxy_log.serve(sock, stop)))
    server.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for burst in range(1, 11):
                for _ in range(100):
                    sender.sendto(line(200, "/healthz"), sock.getsockname())
                wait_until(lambda n=burst: count("/healthz", "200", "") - before >= 100 * n, 10,
                           f"burst {burst} counted")
    finally:
        stop.set()
        server.join(timeout=5)
        sock.close()
    assert count("/healthz", "200", "") - before == 1000
    assert counted == [1000]
