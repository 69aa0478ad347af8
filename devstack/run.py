"""`make run`: a real local Triton (from the pytriton wheel) and the shim under gunicorn, until Ctrl-C.

    python devstack/run.py [--port 5000] [--triton-http-port 8000] [--mode triton|legacy|shadow|canary]

Triton's log goes to a file (its path is printed), the shim's JSON lines to this terminal; if either dies, both
stop. Triton has no admin key (tritonserver takes keys on its command line, which `ps` shows every user): its
trace and logging APIs are closed, load/unload and shared memory open on loopback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devstack import EmbeddedTriton, EmbeddedTritonConfig, EmbeddedTritonError  # noqa: E402
from devstack.waiting import WaitTimeout, exited, wait_for_http  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=int(os.environ.get("SHIM_PORT", "5000")))
    p.add_argument("--triton-http-port", type=int, default=8000)
    p.add_argument("--triton-grpc-port", type=int, default=8001)
    p.add_argument("--triton-metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", type=Path, default=ROOT / "triton_repo")
    p.add_argument("--mode", default=None, help="initial traffic mode (default: $SHIM_MODE, else triton)")
    return p.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="run_local: %(message)s")
    args = parse_args()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    print("run_local: starting Triton (the first start takes a while: it loads every model)...", flush=True)
    try:
        triton = EmbeddedTriton(EmbeddedTritonConfig(
            model_repository=args.model_repository, http_port=args.triton_http_port, grpc_port=args.triton_grpc_port,
            metrics_port=args.triton_metrics_port, closed_apis=("trace", "logging"))).start()
    except (OSError, EmbeddedTritonError) as e:
        print(f"run_local: {e}", file=sys.stderr)
        return 2
    print(f"run_local: Triton ready at {triton.http_url} (metrics {triton.metrics_url}, log {triton.log_path})",
          flush=True)

    env = {**os.environ, "SHIM_TRITON_URL": triton.http_url, "SHIM_PORT": str(args.port)}
    for unused in ("SHIM_TRITON_ADMIN_KEY", "SHIM_TRITON_ADMIN_KEY_FILE"):  # this Triton wants none
        env.pop(unused, None)
    if args.mode:
        env["SHIM_MODE"] = args.mode
    # A flag file shim-traffic can find from another shell; this run's switches last until the next run.
    if not env.get("SHIM_FLAG_FILE"):
        env["SHIM_FLAG_FILE"] = str(Path(tempfile.gettempdir()) / f"shim-traffic-{args.port}.json")
        Path(env["SHIM_FLAG_FILE"]).unlink(missing_ok=True)  # the last run's switches
    shim = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf"], cwd=ROOT, env=env)
    status = 0
    try:
        try:
            wait_for_http(f"http://127.0.0.1:{args.port}/readyz", 120, give_up=exited(shim, "the shim"))
        except WaitTimeout:
            if shim.poll() is None:
                print(f"run_local: the shim is up but not ready; see http://localhost:{args.port}/readyz", flush=True)
        else:
            print(f"""
run_local: the shim is ready on http://localhost:{args.port}  (Ctrl-C stops the shim and Triton)
  curl -F image=@your.jpg http://localhost:{args.port}/predict
  python -c 'import requests; print(requests.post("http://localhost:{args.port}/predict",
             files={{"image": open("your.jpg", "rb")}}).json())'
  SHIM_FLAG_FILE={env["SHIM_FLAG_FILE"]} shim-traffic set canary --canary-percent 10   # every worker

run_local: hot reload after a model's files change:
  curl -X POST http://{triton.http_url}/v2/repository/models/resnet50/load
""", flush=True)
        while not stop.wait(0.5):
            died = (f"the shim exited with status {shim.returncode}" if shim.poll() is not None
                    else None if triton.running else f"Triton exited unexpectedly; see {triton.log_path}")
            if died:
                print(f"run_local: {died}", file=sys.stderr)
                status = 1
                break
    finally:
        if shim.poll() is None:
            shim.send_signal(signal.SIGTERM)  # gunicorn stops gracefully; its workers close Triton clients
            try:
                shim.wait(timeout=30)
            except subprocess.TimeoutExpired:
                shim.kill()
        triton.stop()
        print("run_local: stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
