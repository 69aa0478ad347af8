"""nginx in front of a shim, as docker compose and Kubernetes run it: for the tests (tests/hostile/, test_deploy).

    python devstack/proxy.py --upstream 127.0.0.1:5000 [--port 8080]    # until Ctrl-C

deploy/nginx/nginx.conf.template rendered as the images' entrypoint renders it, in a prefix folder of its own
(never the system's nginx service). Its limits follow the shim's SHIM_* settings; PROXY_MAX_BODY_MB,
PROXY_MAX_INFLIGHT and PROXY_TRUSTED_ADDRESSES override them, and a pair that disagrees is refused
(docs/proxy.md). The binary is `make nginx`'s (.cache/tools/nginx) or an `nginx` on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.settings import Settings  # noqa: E402
from devstack.launch import free_port  # noqa: E402

TEMPLATE = ROOT / "deploy" / "nginx" / "nginx.conf.template"
ENTRYPOINT_SCRIPT = ROOT / "deploy" / "nginx" / "trusted-proxies.envsh"  # sourced before envsubst, as in the image
VARIABLES = ("PROXY_PORT", "PROXY_UPSTREAM", "PROXY_MAX_BODY_MB", "PROXY_MAX_INFLIGHT", "PROXY_ADMISSION_SOCKET",
             "PROXY_LOG_ADDRESS", "PROXY_REAL_IP_FROM")
INPUTS = ("PROXY_TRUSTED_ADDRESSES",)  # read by ENTRYPOINT_SCRIPT, not by the template
UNPACKED = ROOT / ".cache" / "tools" / "nginx" / "usr" / "sbin" / "nginx"
LIVENESS = "/proxy-healthz"  # nginx's own location: answers without the upstream
MISSING = ("nginx is missing: `make nginx` unpacks Debian's package into .cache/tools/nginx (needs apt-get, "
           "no root), or install nginx (apt-get install nginx, brew install nginx)")


def nginx_binary() -> Path | None:
    """`make nginx`'s binary, else one on PATH (or in /usr/sbin, which a user's PATH may lack)."""
    if UNPACKED.is_file():
        return UNPACKED
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    return Path(found) if found else None


_NAME = re.compile(r"\$\{(PROXY_[A-Z0-9_]+)\}|\$(PROXY_[A-Z0-9_]+)")


def template_variables(text: str) -> set[str]:
    """The PROXY_* names a template uses, as `$NAME` or `${NAME}`."""
    return {a or b for a, b in _NAME.findall(text)}


def entrypoint(values: dict[str, str], script: Path = ENTRYPOINT_SCRIPT) -> dict[str, str]:
    """`values` with PROXY_REAL_IP_FROM, as the image's sourced trusted-proxies.envsh exports it (it also removes
    a stale admission socket). ValueError: it refused."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **values}
    result = subprocess.run(["sh", "-c", '. "$0" && printf %s "$PROXY_REAL_IP_FROM"', str(script)], env=env,
                            capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise ValueError(result.stderr.strip() or f"{script.name} failed ({result.returncode})")
    return {**values, "PROXY_REAL_IP_FROM": result.stdout}


def render(values: dict[str, str], template: Path = TEMPLATE) -> str:
    """envsubst with the variables' names as its SHELL-FORMAT: `$NAME` and `${NAME}` of those names only."""
    text = template.read_text()
    missing = set(VARIABLES) - set(values)
    if missing:
        raise ValueError(f"no value for {sorted(missing)}")
    unknown = template_variables(text) - set(VARIABLES)
    if unknown:
        raise ValueError(f"{template} uses {sorted(unknown)}, which devstack/proxy.py VARIABLES does not list")
    return _NAME.sub(lambda m: values[m.group(1) or m.group(2)], text)


def command(binary: Path, prefix: Path, *extra: str) -> list[str]:
    """The deployments' command line, with this prefix. As root, `user root`: nginx's default worker user cannot
    enter pytest's 0700 temporary folders, and every buffered upload would fail with 500."""
    settings = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
    return [str(binary), "-e", "stderr", "-p", f"{prefix}/", "-c", str(prefix / "nginx.conf"), *extra, "-g", settings]


def values_for(upstream: str, port: int, settings: Settings | None = None, *, prefix: Path,
               trusted: str = "") -> dict[str, str]:
    """The variables for a shim with these settings at `upstream`: its limits and where it receives nginx's
    access log (without SHIM_PROXY_LOG_ADDRESS, a port where nothing listens: nginx drops every line)."""
    settings = settings or Settings()
    if settings.max_upload_mb != int(settings.max_upload_mb):
        raise ValueError(f"nginx takes a whole number of MiB; the shim's limit is {settings.max_upload_mb}")
    log_host, _, log_port = settings.proxy_log_address.rpartition(":")
    log_address = (f"{'127.0.0.1' if log_host in {'0.0.0.0', '::', '[::]'} else log_host}:{log_port}"
                   if settings.proxy_log_address else f"127.0.0.1:{free_udp_port()}")
    return {"PROXY_PORT": f"127.0.0.1:{port}", "PROXY_UPSTREAM": upstream,
            "PROXY_MAX_BODY_MB": str(int(settings.max_upload_mb)),
            "PROXY_MAX_INFLIGHT": str(settings.max_pending),
            "PROXY_ADMISSION_SOCKET": str(prefix / "admission.sock"), "PROXY_LOG_ADDRESS": log_address,
            "PROXY_TRUSTED_ADDRESSES": trusted}


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


def check_limits(values: dict[str, str], settings: Settings) -> None:
    """The pairs of limits nginx and the shim must agree on (docs/proxy.md "What must hold between nginx and the
    shim"); a ValueError names every pair that does not hold."""
    wrong = []
    body, inflight = values.get("PROXY_MAX_BODY_MB", ""), values.get("PROXY_MAX_INFLIGHT", "")
    if not body.isdigit() or int(body) != settings.max_upload_mb:
        wrong.append(f"PROXY_MAX_BODY_MB={body!r} must equal SHIM_MAX_UPLOAD_MB={settings.max_upload_mb:g}")
    if not inflight.isdigit() or not 1 <= int(inflight) <= settings.max_pending:
        wrong.append(f"PROXY_MAX_INFLIGHT={inflight!r} must be from 1 to SHIM_MAX_PENDING={settings.max_pending}")
    target = values.get("PROXY_LOG_ADDRESS", "")
    if settings.proxy_log_address and settings.proxy_log_address.rpartition(":")[2] != target.rpartition(":")[2]:
        wrong.append(f"SHIM_PROXY_LOG_ADDRESS={settings.proxy_log_address} must have the port of "
                     f"PROXY_LOG_ADDRESS={target}, where nginx sends its access log")
    if wrong:
        raise ValueError("nginx and the shim disagree: " + "; ".join(wrong))


def check(values: dict[str, str], template: Path = TEMPLATE,
          binary: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on the rendered template, in a scratch prefix (nginx -t binds the admission socket)."""
    binary = binary or nginx_binary()
    if binary is None:
        raise FileNotFoundError(MISSING)
    with tempfile.TemporaryDirectory(prefix="proxy-check-") as scratch:
        prefix = Path(scratch)
        values = {**values, "PROXY_ADMISSION_SOCKET": str(prefix / "admission.sock")}
        if "PROXY_REAL_IP_FROM" not in values:
            values = entrypoint(values)
        (prefix / "nginx.conf").write_text(render(values, template))
        return subprocess.run(command(binary, prefix, "-t"), capture_output=True, text=True, timeout=60, check=False)


class Proxy:
    """nginx with deploy/nginx's configuration in a subprocess, in front of `upstream`."""

    def __init__(self, folder: Path, upstream: str, *, settings: Settings | None = None, port: int | None = None,
                 trusted: str = "", overrides: dict[str, str] | None = None) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError(MISSING)
        settings = settings or Settings()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = folder
        folder.mkdir(parents=True, exist_ok=True)
        values = {**values_for(upstream, self.port, settings, prefix=self.prefix, trusted=trusted), **(overrides or {})}
        check_limits(values, settings)
        self.values = entrypoint(values)
        (self.prefix / "nginx.conf").write_text(render(self.values))
        self.access_log_path = self.prefix / "access.log"  # the config's /dev/stdout
        self.error_log_path = self.prefix / "error.log"    # its stderr
        self._stdout = self.access_log_path.open("ab")
        self._stderr = self.error_log_path.open("ab")
        self.process = subprocess.Popen(command(binary, self.prefix), stdout=self._stdout, stderr=self._stderr,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout_s: float = 30) -> Proxy:
        """Until nginx's own liveness answers; fails with its error log."""
        from devstack.waiting import WaitTimeout, exited, wait_for_http

        try:
            wait_for_http(self.url + LIVENESS, timeout_s, what=f"nginx on {self.url}",
                          give_up=exited(self.process, "nginx"))
        except WaitTimeout as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.error_log()}") from None
        return self

    def error_log(self) -> str:
        return self.error_log_path.read_text(errors="replace")[-6000:]

    def access_log(self) -> list[dict[str, Any]]:
        """Every access log line, parsed: each must be one JSON object."""
        lines = self.access_log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def stop(self) -> None:
        """Graceful (SIGQUIT: open requests finish), then SIGTERM, then the process group killed."""
        for sig, wait_s in ((signal.SIGQUIT, 10), (signal.SIGTERM, 5)):
            if self.process.poll() is None:
                self.process.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=wait_s)
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._stdout.close()
        self._stderr.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--upstream", default="127.0.0.1:5000", help="gunicorn's host:port")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--dir", type=Path, default=None, help="nginx's prefix (default: a temporary folder)")
    args = p.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="shim-proxy-"))
    try:
        given = {name: os.environ[name] for name in ("PROXY_MAX_BODY_MB", "PROXY_MAX_INFLIGHT") if name in os.environ}
        proxy = Proxy(folder, args.upstream, settings=Settings.from_env(), port=args.port, overrides=given,
                      trusted=os.environ.get("PROXY_TRUSTED_ADDRESSES", "")).wait()
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    print(f"proxy: nginx on {proxy.url} -> {args.upstream}; access log {proxy.access_log_path}, "
          f"errors {proxy.error_log_path} (Ctrl-C stops it)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5) and proxy.process.poll() is None:
            pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
