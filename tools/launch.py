"""Start a WSGI app under real gunicorn in a subprocess and wait for it: used by tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ServedApp:
    """A WSGI app under real gunicorn in a subprocess; its log goes to a file that failures print."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait(self, path: str, timeout_s: float = 120, status: int = 200) -> ServedApp:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}):\n{self.log()}")
            try:
                if requests.get(self.url + path, timeout=5).status_code == status:
                    return self
            except (requests.ConnectionError, requests.Timeout):  # a worker still importing torch: ask again
                pass
            time.sleep(0.25)
        raise AssertionError(f"{self.name}: {path} not {status} within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()




def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_shim(log_dir: Path, env: dict[str, str], port: int | None = None) -> ServedApp:
    """The shim under gunicorn with gunicorn.conf.py, as `make run` starts it; `env` holds SHIM_* settings.

    Nothing of the caller's SHIM_* environment leaks in: the run is defined by `env` alone.
    """
    port = port or free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    full = {**clean, "SHIM_HOST": "127.0.0.1", "SHIM_PORT": str(port), **env}
    cmd = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"]
    return ServedApp("shim", cmd, full, port, log_dir / f"shim-{port}.log")


def start_legacy_app(log_dir: Path, *, model_pt: Path, labels: Path, threads: int = 4,
                     port: int | None = None) -> ServedApp:
    """examples/legacy_app.py as a team ran it before the migration: one gunicorn process."""
    port = port or free_port()
    env = {**os.environ, "LEGACY_MODEL_PATH": str(model_pt), "LEGACY_LABELS_PATH": str(labels)}
    cmd = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1",
           "--threads", str(threads), "--no-control-socket", "examples.legacy_app:app"]
    return ServedApp("legacy app", cmd, env, port, log_dir / f"legacy-{port}.log")
