"""The hostile-clients suite (`make hostile-test`): the real stack, attacked, measured and checked.

One stack for the session, as users deploy it: the wheel's Triton serving modelrepo/standin.py's copy of
triton_repo (a near-free numpy `resnet50` with the real interface, so that the shim's front end, not the
model, is what the floods and slow clients stress; the SIGSTOP scenario needs no real model either), the
shim under gunicorn exactly as `make run` starts it (devstack/launch.start_shim, app/gunicorn_conf.py, every
SHIM_* setting at its default but those a deployment sets behind nginx: SHIM_PROXY_HOPS=1 and
SHIM_PROXY_LOG_ADDRESS), and nginx with deploy/nginx's configuration in front (devstack/proxy.py). Normal clients
and probes come from 127.0.0.1, attackers from other loopback addresses.

Collected only with HOSTILE_STACK=1 (the Makefile target sets it): `make test` never runs it. The figures
each scenario measured are printed at the end, and written to .cache/hostile/figures.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from devstack import EmbeddedTriton, launch, proxy
from devstack.launch import ServedApp
from tests.support import ROOT, encode, photo

collect_ignore_glob = [] if os.environ.get("HOSTILE_STACK") == "1" else ["test_*.py"]

FIGURES = ROOT / ".cache" / "hostile" / "figures.md"


@dataclass
class Stack:
    triton: EmbeddedTriton
    shim: ServedApp
    proxy: proxy.Proxy
    settings: Settings  # the shim's settings, as app/gunicorn_conf.py reads them from the same environment
    image: bytes  # what normal clients send: a 640x480 JPEG
    config: str  # the rendered nginx configuration

    @property
    def proxy_port(self) -> int:
        return self.proxy.port

    @property
    def shim_port(self) -> int:
        return self.shim.port

    @property
    def triton_pid(self) -> int:
        return tritonserver_pid(self.triton)

    def log_mark(self) -> int:
        """Where nginx's access log ends now: log_since(mark) reads what a scenario added."""
        return self.proxy.access_log_path.stat().st_size

    def log_since(self, mark: int) -> list[dict[str, Any]]:
        with self.proxy.access_log_path.open("rb") as f:
            f.seek(mark)
            return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]

    def directive(self, name: str, context: str = "") -> str:
        """One directive's value in the rendered nginx configuration (the first, after `context` if given)."""
        text = self.config[self.config.index(context):] if context else self.config
        match = re.search(rf"^\s*{re.escape(name)}\s+([^;]+);", text, re.M)
        assert match, f"{name} is not in deploy/nginx/nginx.conf.template"
        return match.group(1).strip()

    def predict_limits(self) -> dict[str, int]:
        """The limit_conn values of the /predict locations, by zone: shim_predict_per_client (the edge server,
        requests still sending their body included), shim_predict_total (the admission server: complete ones)."""
        blocks = [part.split("\n        }")[0] for part in self.config.split("location = /predict {")[1:]]
        return {zone: int(n) for block in blocks for zone, n in re.findall(r"limit_conn (\w+) (\d+);", block)}

    def proxy_counts(self) -> dict[tuple[str, str, str], float]:
        """shim_proxy_responses_total by (path, status, reason), as the shim's /metrics serves it."""
        from devstack import promtext

        return {(s.labels["path"], s.labels["status"], s.labels["reason"]): s.value
                for s in promtext.scrape(self.shim.url + "/metrics", timeout_s=10)
                if s.name == "shim_proxy_responses_total"}

    def nginx_private_kib(self, front: proxy.Proxy | None = None) -> int:
        """The private memory of an nginx's processes (master and workers; the stack's by default), from
        /proc/<pid>/smaps_rollup."""
        total = 0
        master = (front or self.proxy).process.pid
        for pid in [master, *worker_pids(master)]:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith(("Private_Clean:", "Private_Dirty:")):
                        total += int(line.split()[1])
        return total

    def seconds(self, name: str) -> float:
        value = self.directive(name)
        match = re.fullmatch(r"(\d+)(ms|s|m)?", value)
        assert match, f"{name} {value}: not a time this suite reads"
        return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[match.group(2)]


@dataclass
class Figures:
    """What the scenarios measured, printed as one table at the end (for the closing note)."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, scenario: str, what: str, value: object) -> None:
        if isinstance(value, float):
            value = f"{value:.3f}" if value < 10 else f"{value:.1f}"
        self.rows.append((scenario, what, str(value)))

    def table(self) -> str:
        lines = ["| scenario | measure | value |", "|---|---|---|"]
        lines += [f"| {s} | {w} | {v} |" for s, w, v in self.rows]
        return "\n".join(lines)


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES.rows:
        return
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(_FIGURES.table() + "\n")
    terminalreporter.section("hostile clients: figures measured")
    terminalreporter.write_line(_FIGURES.table())
    terminalreporter.write_line(f"(also in {FIGURES.relative_to(ROOT)})")


def tritonserver_pid(triton: EmbeddedTriton) -> int:
    assert triton.pid is not None, "Triton is not running"
    return triton.pid  # the tritonserver binary itself


def worker_pids(master: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]
    return []


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from modelrepo.standin import write_standin_repo
    from tests.conftest import start_triton

    if proxy.nginx_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(proxy.MISSING)
        pytest.skip(proxy.MISSING)
    base = tmp_path_factory.mktemp("hostile")
    repo = write_standin_repo(base / "standin_repo")
    triton = start_triton(repo, base / "triton-cache")
    shim_env = {"SHIM_TRITON_URL": triton.http_url, "SHIM_MODEL_REPOSITORY": str(repo),
                "SHIM_MODE": "triton", "SHIM_PROXY_HOPS": "1",
                "SHIM_PROXY_LOG_ADDRESS": f"127.0.0.1:{proxy.free_udp_port()}"}
    shim = launch.start_shim(base, shim_env)
    front: proxy.Proxy | None = None
    pids: list[int] = []
    try:
        shim.wait("/readyz", timeout_s=120)
        pids = worker_pids(shim.process.pid)
        settings = Settings.from_env({**shim_env, "SHIM_PORT": str(shim.port)})
        front = proxy.Proxy(base / "nginx", f"127.0.0.1:{shim.port}", settings=settings).wait()
        yield Stack(triton, shim, front, settings, encode(photo(640, 480, seed=5)),
                    (front.prefix / "nginx.conf").read_text())
    finally:
        with contextlib.suppress(ProcessLookupError, AssertionError):  # a scenario that died between its signals
            os.kill(tritonserver_pid(triton), signal.SIGCONT)
        if front is not None:
            front.stop()
        shim.stop()
        triton.stop()
    # Nothing of ours left in /dev/shm: the shim's regions (shim_<host>_<pid>_...) and Triton's (its prefix).
    left = [p for p in Path("/dev/shm").glob("*")
            if p.name.startswith(triton.shm_prefix) or any(f"_{pid}_" in p.name for pid in pids)]
    for path in left:
        path.unlink(missing_ok=True)
    assert not left, f"left in /dev/shm (now removed): {[p.name for p in left]}"


@pytest.fixture
def healthy(stack: Stack) -> Stack:
    """The stack answering through the proxy before a scenario starts (the one before may have shaken it)."""
    from devstack.waiting import wait_for_http

    wait_for_http(stack.proxy.url + "/readyz", 60, what="/readyz through nginx to answer 200")
    return stack
