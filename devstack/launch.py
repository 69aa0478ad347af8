"""Start a WSGI app under real gunicorn in a subprocess and wait for it: used by tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ServedApp:
    """A WSGI app under real gunicorn in a subprocess; its log goes to a file that failures print."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log_path: Path,
                 cwd: Path = ROOT) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait(self, path: str, timeout_s: float = 120, status: int = 200) -> ServedApp:
        """Until `path` answers `status` (a worker may still be importing torch); fails with the log."""
        from devstack.waiting import WaitTimeout, exited, wait_for_http

        try:
            wait_for_http(self.url + path, timeout_s, status=status, what=f"{self.name}: {path} to answer {status}",
                          give_up=exited(self.process, self.name))
        except WaitTimeout as e:
            log = self.log()
            self.stop()
            raise AssertionError(f"{e}:\n{log}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, *, graceful: bool = True) -> None:
        """SIGTERM: in-flight requests finish (seconds); else SIGQUIT, quick (the master still reaps the workers)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM if graceful else signal.SIGQUIT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_shim(log_dir: Path, env: dict[str, str], port: int | None = None, root: Path = ROOT) -> ServedApp:
    """The shim under gunicorn as `make run` starts it, with the SHIM_* settings of `env` alone; `root`: the checkout
    whose app/ runs (bench --ab compares two)."""
    port = port or free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    full = {**clean, "SHIM_PORT": str(port), **env}
    cmd = [sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf"]
    return ServedApp("shim", cmd, full, port, log_dir / f"shim-{port}.log", cwd=root)


def start_legacy_app(log_dir: Path, *, model_pt: Path, labels: Path, threads: int = 4,
                     port: int | None = None, env: dict[str, str] | None = None) -> ServedApp:
    """examples/legacy_app.py as a team ran it before the migration: one gunicorn process; `env`: LEGACY_*."""
    port = port or free_port()
    env = {**os.environ, "LEGACY_MODEL_PATH": str(model_pt), "LEGACY_LABELS_PATH": str(labels), **(env or {})}
    cmd = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1",
           "--threads", str(threads), "--no-control-socket", "examples.legacy_app:app"]
    return ServedApp("legacy app", cmd, env, port, log_dir / f"legacy-{port}.log")
