"""python -m devstack: serve a model repository with the wheel's Triton until Ctrl-C.

    python -m devstack [options] [-- tritonserver options...]

With an admin key, Triton's model-repository, shared-memory, trace and logging APIs answer only requests that
carry it in the header --admin-header (gRPC: metadata `triton-grpc-protocol-<header>`; docs/triton-admin.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from devstack.errors import EmbeddedTritonError
from devstack.server import EmbeddedTriton, EmbeddedTritonConfig


def parse_args(argv: list[str] | None) -> EmbeddedTritonConfig:
    p = argparse.ArgumentParser(prog="python -m devstack", description=__doc__)
    p.add_argument("--model-repository", type=Path, default=Path("triton_repo"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the CPU copy and the log go (default: under ~/.cache/flask-triton-shim)")
    p.add_argument("--model-control-mode", choices=["explicit", "poll", "none"], default="explicit")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--quiet", action="store_true", help="keep Triton's own log in the log file only")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--admin-key", default=os.environ.get("TRITON_ADMIN_KEY", ""),
                     help="restrict the admin APIs to requests with this key (default: $TRITON_ADMIN_KEY; none: "
                          "unrestricted); on tritonserver's command line, which every user reads: for tests")
    key.add_argument("--admin-key-file", type=Path, help="the same key, read from a file (a secret)")
    p.add_argument("--admin-header", default="triton-admin-key", help="the header that carries the key")
    p.add_argument("tritonserver_args", nargs="*", metavar="-- TRITONSERVER_OPTION",
                   help="after `--`: options passed on to tritonserver")
    a = p.parse_args(argv)
    admin_key = a.admin_key
    if a.admin_key_file is not None:
        try:
            admin_key = a.admin_key_file.read_text().strip()
        except OSError as e:
            raise EmbeddedTritonError(f"--admin-key-file {a.admin_key_file} cannot be read ({e.strerror})") from None
        if not admin_key:
            raise EmbeddedTritonError(f"--admin-key-file {a.admin_key_file} is empty")
    return EmbeddedTritonConfig(
        model_repository=a.model_repository, host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
        metrics_port=a.metrics_port, cache_dir=a.cache_dir, model_control_mode=a.model_control_mode,
        startup_timeout_s=a.startup_timeout, echo_log=not a.quiet, admin_key=admin_key,
        admin_header=a.admin_header, extra_args=tuple(a.tritonserver_args))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="embedded_triton: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = parse_args(argv)
        server = EmbeddedTriton(config).start()
    except EmbeddedTritonError as e:
        print(f"embedded_triton: {e}", file=sys.stderr)
        return 2
    print(f"embedded_triton: ready: HTTP {server.http_url}, gRPC {config.host}:{config.grpc_port}, "
          f"metrics {server.metrics_url}; log {server.log_path}; Ctrl-C stops", file=sys.stderr, flush=True)
    if config.admin_key:
        print(f"embedded_triton: the model-repository, shared-memory, trace and logging APIs need the header "
              f"'{config.admin_header}: <the admin key>'", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            if not server.running:
                print(f"embedded_triton: tritonserver exited unexpectedly; see {server.log_path}", file=sys.stderr)
                return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
