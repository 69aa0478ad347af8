"""A real Triton server, from the nvidia-pytriton wheel, serving a model repository on loopback."""

from __future__ import annotations

import collections
import contextlib
import glob
import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

from devstack.cpu_repo import check_model_files, sync_cpu_repo
from devstack.errors import EmbeddedTritonError
from devstack.waiting import WaitTimeout, wait_for_http
from devstack.wheel import TritonWheel, find_wheel, server_environment

log = logging.getLogger("embedded_triton")
# What an admin key restricts; inference, health, metadata and statistics stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
# A header no HTTP request can carry (docs/triton-admin.md): APIs restricted to it are closed to everyone.
CLOSED_HEADER = "closed:api"
_ADMIN_KEY = re.compile(r"^[A-Za-z0-9._~+/-]{16,}$")  # Triton's flag syntax leaves no room for , : = or spaces
# Error lines that a Triton without GPU always prints; they hide the real cause of a failed start.
HARMLESS = ("CudaDriverHelper", "CUDA driver", "NVML", "DCGM", "unable to create stream",
            # nvImageCodec (resnet50_decode) names the GPU codecs it cannot load; its CPU decoder still works
            "nvjpeg", "nvJPEG", "nvtiff", "nvTIFF")


@dataclass(frozen=True, kw_only=True)
class EmbeddedTritonConfig:
    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_dir: Path | None = None  # default: a folder per repository and port under ~/.cache
    model_control_mode: str = "explicit"  # explicit: load/unload through the repository API
    startup_timeout_s: float = 180.0
    sync_interval_s: float = 1.0  # how often the CPU copy follows changes in model_repository
    response_cache_bytes: int = 64 * 1024 * 1024  # only used by models with response_cache enabled
    exit_timeout_s: int = 3
    log_verbose: int = 0
    echo_log: bool = False  # also write Triton's log to stderr (the CLI does)
    # RESTRICTED_APIS answer only requests with it; on tritonserver's command line: for tests only.
    admin_key: str = field(default="", repr=False)
    closed_apis: tuple[str, ...] = ()  # answered 403 to every request (CLOSED_HEADER); not with admin_key
    admin_header: str = "triton-admin-key"
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    gpu: bool = False  # keep KIND_GPU instances (a host with a GPU); by default every instance runs on the CPU

    def __post_init__(self) -> None:
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        if len(set(ports)) != 3 or not all(0 < p < 65536 for p in ports):
            raise EmbeddedTritonError(f"HTTP, gRPC and metrics ports must be three distinct ports, got {ports}")
        if self.admin_key and not _ADMIN_KEY.match(self.admin_key):
            raise EmbeddedTritonError("the admin key must be at least 16 characters of letters, digits and ._~+/- "
                                      "(e.g. openssl rand -hex 16)")
        if not re.fullmatch(r"[A-Za-z0-9-]+", self.admin_header):
            raise EmbeddedTritonError(f"the admin header must be a header name, not {self.admin_header!r}")
        if self.admin_key and self.closed_apis:
            raise EmbeddedTritonError("an admin key restricts the admin APIs already: close none besides")
        if not set(self.closed_apis) <= set(RESTRICTED_APIS):
            raise EmbeddedTritonError(f"only {', '.join(RESTRICTED_APIS)} can be closed, not {self.closed_apis}")
        if self.model_control_mode not in {"explicit", "poll", "none"}:
            raise EmbeddedTritonError(f"model control mode must be explicit, poll or none, "
                                      f"not {self.model_control_mode!r}")

    @property
    def admin_headers(self) -> dict[str, str]:
        """What a request to a restricted API must carry; {} when nothing is restricted."""
        return {self.admin_header: self.admin_key} if self.admin_key else {}

    @property
    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        key = hashlib.sha1(str(self.model_repository.resolve()).encode()).hexdigest()[:10]
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flask-triton-shim"
        return root / "embedded-triton" / f"{self.model_repository.name}-{key}-{self.http_port}"


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: connections of a server that just stopped (TIME_WAIT) do not make a port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedTriton:
    """Start, watch and stop one tritonserver process. Use as a context manager."""

    def __init__(self, config: EmbeddedTritonConfig, wheel: TritonWheel | None = None) -> None:
        self.config = config
        self.wheel = wheel
        self.cache_dir = config.resolved_cache_dir.resolve()
        self.cpu_repo = self.cache_dir / "model_repository"
        self.log_path = self.cache_dir / "tritonserver.log"
        # Two servers, or a test run beside `make run`, must never share python-backend shm regions.
        self.shm_prefix = f"shim{os.getpid()}x{uuid.uuid4().hex[:6]}_"
        self._process: subprocess.Popen[bytes] | None = None
        self._log_tail: collections.deque[str] = collections.deque(maxlen=200)
        self._first_line = ""  # what a server that will not start says first (an unknown option: before its usage)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pump: threading.Thread | None = None  # the thread that reads its output into the log

    @property
    def http_url(self) -> str:
        return f"{self.config.host}:{self.config.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """The tritonserver process, while it runs (tests stop and continue it)."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self, wheel: TritonWheel) -> list[str]:
        c = self.config
        cmd = [
            str(wheel.binary),
            f"--model-repository={self.cpu_repo}",
            f"--backend-directory={wheel.backend_directory(self.cache_dir / 'backends')}",
            f"--cache-directory={wheel.caches}",
            *([] if any(a.startswith("--cache-config") for a in c.extra_args)  # compose's own, passed on
              else [f"--cache-config=local,size={c.response_cache_bytes}"]),
            f"--http-address={c.host}", f"--http-port={c.http_port}",
            f"--grpc-address={c.host}", f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.host}", f"--metrics-port={c.metrics_port}",
            "--allow-gpu-metrics=false",
            *([] if c.gpu else ["--pinned-memory-pool-byte-size=0"]),
            f"--exit-timeout-secs={c.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--model-control-mode={c.model_control_mode}",
            f"--log-verbose={c.log_verbose}",
        ]
        # explicit: load everything at start, load/unload later through the API
        cmd += {"explicit": ["--load-model=*"], "poll": ["--repository-poll-secs=2"]}.get(c.model_control_mode, [])
        if c.admin_key or c.closed_apis:  # Triton's syntax: <api>,<api>:<header>=<value>, for HTTP and gRPC alike
            rule = (f"{','.join(RESTRICTED_APIS)}:{c.admin_header}={c.admin_key}" if c.admin_key
                    else f"{','.join(c.closed_apis)}:{CLOSED_HEADER}=closed")
            cmd += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        return [*cmd, *c.extra_args]

    def start(self) -> Self:
        c = self.config
        wheel = self.wheel or find_wheel()
        check_model_files(c.model_repository)
        for name, port in [("HTTP", c.http_port), ("gRPC", c.grpc_port), ("metrics", c.metrics_port)]:
            if not port_is_free(c.host, port):
                raise EmbeddedTritonError(f"{name} port {c.host}:{port} is busy (is `make run` or another Triton "
                                          "already running?); stop it or choose other ports")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        changed = sync_cpu_repo(c.model_repository, self.cpu_repo, gpu=c.gpu)
        log.info("CPU copy of %s at %s (%s)", c.model_repository, self.cpu_repo,
                 f"regenerated: {', '.join(changed)}" if changed else "up to date")

        log_file = self.log_path.open("ab")
        self._process = subprocess.Popen(
            self.command(wheel), env=server_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)  # own process group: stubs die with it
        self._pump = self._spawn(self._pump_log, self._process.stdout, log_file)
        try:
            self.wait_ready(c.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        if c.model_control_mode != "none" and c.sync_interval_s > 0:
            self._spawn(self._follow_repository)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        try:
            wait_for_http(f"http://{self.http_url}/v2/health/ready", timeout_s, what="tritonserver to be ready",
                          give_up=lambda: None if self.running else "tritonserver exited")
        except WaitTimeout as e:
            if self.running:
                what = f"was not ready within {timeout_s:.0f} s"
            else:  # its last lines may still be in the pipe: read them before saying what they were
                if self._pump is not None:
                    self._pump.join(timeout=5)
                what = f"exited during start-up ({self._exit_status()})"
            raise EmbeddedTritonError(f"tritonserver {what}: {self._errors()}; full log: {self.log_path}") from e

    def stop(self, *, graceful: bool = True) -> None:
        """Drained and unloaded (a few seconds), or killed at once with its stubs; its /dev/shm files go too."""
        self._stop.set()
        process, self._process = self._process, None
        if process is not None:
            if graceful and process.poll() is None:
                process.send_signal(signal.SIGTERM)  # Triton drains, then waits exit_timeout for clients
                try:
                    process.wait(timeout=self.config.exit_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver did not stop in time; killing its process group")
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the server if still up, and its stubs
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        if process is not None and process.stdout is not None:
            process.stdout.close()
        for leftover in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target: object, *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)
        return thread

    def _pump_log(self, stream: IO[bytes], log_file: IO[bytes]) -> None:
        with log_file:
            for raw in iter(stream.readline, b""):
                log_file.write(raw)
                log_file.flush()
                line = raw.decode(errors="replace").rstrip()
                self._first_line = self._first_line or line.strip()
                self._log_tail.append(line)
                if self.config.echo_log:
                    print(line, file=sys.stderr, flush=True)

    def _follow_repository(self) -> None:
        while not self._stop.wait(self.config.sync_interval_s):
            try:
                changed = sync_cpu_repo(self.config.model_repository, self.cpu_repo, gpu=self.config.gpu)
            except (EmbeddedTritonError, OSError) as e:  # a half-edited config: report and keep serving
                log.warning("CPU copy not updated: %s", e)
                continue
            if changed:
                log.info("model repository changed (%s): CPU copy updated; load the model to apply it",
                         ", ".join(changed))

    def _exit_status(self) -> str:
        code = self._process.poll() if self._process is not None else None
        if code is None or code >= 0:
            return f"exit code {code}"
        # SIGKILL: the OOM killer, most often; SIGPIPE: nothing read its output
        names = {int(s): s.name for s in signal.Signals}
        killed = f"killed by {names.get(-code, f'signal {-code}')}"
        if code == -signal.SIGBUS:  # a python-backend region on a full tmpfs (docker's default /dev/shm is 64 MiB)
            shm = os.statvfs("/dev/shm")
            killed += f", with {shm.f_bavail * shm.f_frsize / 2**20:.0f} MiB free in /dev/shm now"
        return killed

    def _errors(self) -> str:
        errors = [line for line in self._log_tail
                  if (line.startswith("E") or "error" in line.lower()) and not any(h in line for h in HARMLESS)]
        if errors:
            return " | ".join(errors[-3:])
        last = next((line.strip() for line in reversed(self._log_tail) if line.strip()), "")
        if not last:
            return "its log is empty"
        return f"no error lines in its log (first line: {self._first_line}; last: {last})"

