"""Triton as `make run` and the deployments start it: no admin key on its command line (where `ps` shows it to
every user of the host), the APIs nobody needs closed instead: restricted to a header no HTTP request can
carry, so that they answer 403 to every request, one that tries to send that header included."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import requests

from devstack import EmbeddedTriton, EmbeddedTritonConfig
from devstack.server import CLOSED_HEADER
from tests.support import free_ports

pytestmark = pytest.mark.triton


def raw_status(host_port: str, head: str) -> int:
    host, port = host_port.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_closed_apis_refuse_everyone_and_the_command_line_holds_no_key(tmp_path: Path) -> None:
    from modelrepo.standin import write_standin_repo

    http, grpc, metrics = free_ports(3)
    config = EmbeddedTritonConfig(model_repository=write_standin_repo(tmp_path / "triton_repo"),
                                  cache_dir=tmp_path / "cache", http_port=http, grpc_port=grpc, metrics_port=metrics,
                                  closed_apis=("trace", "logging"), startup_timeout_s=240)
    server = EmbeddedTriton(config).start()
    try:
        assert server.pid is not None
        args = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode().split("\0")
        restricted = [a for a in args if "restricted" in a]
        assert restricted and all(a.endswith(f":{CLOSED_HEADER}=closed") for a in restricted), restricted
        base = f"http://{server.http_url}"
        for path in ("/v2/trace/setting", "/v2/logging"):
            refused = requests.get(base + path, timeout=30)
            assert refused.status_code == 403 and CLOSED_HEADER in refused.text, refused.text
            # What a client that writes the header gets: the name ends at the ':', the rest is a value.
            assert raw_status(server.http_url, f"GET {path} HTTP/1.1\r\nHost: x\r\n{CLOSED_HEADER}: closed\r\n"
                                               "Connection: close\r\n\r\n") == 403
        assert requests.get(base + "/v2/health/ready", timeout=30).status_code == 200
        assert requests.post(base + "/v2/repository/index", timeout=30).status_code == 200  # not closed here
    finally:
        server.stop(graceful=False)
