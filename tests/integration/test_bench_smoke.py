"""`python -m bench --frontend --quick` end to end: no assertion on speed.

The front-end rows (floor, legacy front, the shim, direct) at one concurrency level with short windows:
every row must answer every request it was sent, the CPU columns must come from the real process trees,
and the report's files parse. The Flask-vs-Triton benchmark's quick form runs in CI as `make bench-quick`
(it exits non-zero when a request fails); its pure parts are in tests/unit/test_bench_parts.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import cpu
from bench.report import cpu_split
from devstack.proxy import nginx_binary
from tests.conftest import start_early, take_early
from tests.support import ROOT

# One of the shim's transports, its default. The benchmark's code is the same for every
# transport (one setting in the shim's environment); tests/integration/test_transports.py covers each of them.
# And `encoded` (Triton decodes the uploads): its row, wrk's cross-check and its target line are issue 19's.
TRANSPORTS = ("fp32", "encoded")
CLIENTS = 8
Run = tuple[Path, dict[str, Any], float]


class QuickRun:
    """`python -m bench --frontend --quick` as a subprocess, its output and log in a folder of its own."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="shim-bench-smoke-"))
        self.out = self.folder / "out"
        self.log = self.folder / "bench.log"
        self.started = time.monotonic()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench", "--frontend", "--quick", "--concurrency", str(CLIENTS),
                 "--warmup", "0.3", "--duration", "1.0", "--legacy-workers", "1",
                 "--transports", ",".join(TRANSPORTS), "--out", str(self.out)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """Nothing when it has finished; else Ctrl-C, on which it stops the servers it started."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# Started when collection ends (tests/conftest.py start_early): it runs while the unit tests do.
start_early("quick_run", QuickRun)


@pytest.fixture(scope="module")
def quick_run() -> Iterator[Run]:
    run = take_early("quick_run", QuickRun)
    try:
        returncode = run.process.wait(timeout=280)
        elapsed = time.monotonic() - run.started
        assert returncode == 0, f"bench exited {returncode}; its output:\n{run.log.read_text()[-8000:]}"
        yield run.out, json.loads((run.out / "results.json").read_text()), elapsed
    finally:
        run.kill()


# -- the front-end rows ---------------------------------------------------------------------------------------

def front_rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in report["results"]}


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_every_front_end_row_answers_without_errors(quick_run: Run) -> None:
    out, report, _ = quick_run
    rows = front_rows(report)
    transports = report["settings"]["transports"]
    assert transports == list(TRANSPORTS)
    behind_nginx = {"shim-encoded-nginx"} if nginx_binary() else set()  # make test unpacks nginx (make nginx)
    assert set(rows) == {"floor", "flask-floor", "legacy-front", *(f"shim-{t}" for t in transports), "direct-front",
                         *behind_nginx}
    for r in rows.values():
        assert (r["errors"], r["warmup_errors"], r["unfinished"]) == (0, 0, 0), r
        assert r["answers"] > 0, r
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], r
    for t in transports:
        row = rows[f"shim-{t}"]
        assert row["transport"] == t
        assert row["transport_reported"] == t, row  # the shim runs what it was asked
        assert row["breakdown"]["shim"]["requests"] > 0 and row["breakdown"]["triton"]["requests"] > 0
    # The near-free model was written into the run's folder, never into triton_repo.
    repo = Path(report["model"]["repository"])
    assert repo.is_relative_to(out) and "backend: \"python\"" in (repo / "resnet50" / "config.pbtxt").read_text()
    assert (ROOT / "triton_repo" / "resnet50" / "1" / "model.py").exists() is False


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_front_end_cpu_comes_from_the_process_trees(quick_run: Run) -> None:
    _, report, _ = quick_run
    rows = front_rows(report)
    usable = len(os.sched_getaffinity(0))
    floor = rows["floor"]
    assert floor["processes"] == usable == floor["cpu"]["floor"]["processes"]
    assert floor["cpu_ms_per_image"]["floor"] > 0
    transports = report["settings"]["transports"]
    expected = {"flask-floor": {"flask", "loadgen"}, "legacy-front": {"legacy", "loadgen"},
                "direct-front": {"triton", "loadgen"},
                **{f"shim-{t}": {"shim", "triton", "loadgen"} for t in transports}}
    if "shim-encoded-nginx" in rows:  # the shim as deployed: nginx's own CPU beside it
        expected["shim-encoded-nginx"] = {"shim", "nginx", "triton", "loadgen"}
    for config, groups in expected.items():
        r = rows[config]
        assert set(r["cpu"]) == groups | {"machine"}, r["cpu"]
        for group in groups - {"loadgen"}:
            assert r["cpu"][group]["cpu_s"] > 0 and r["cpu_ms_per_image"][group] > 0, (config, group, r["cpu"])
        # The load generator is one process counted in 10 ms ticks: the slow legacy row's second of load
        # can fit under one tick on a busy machine (CI saw 0.0), so it must be counted, and busy over the run.
        assert r["cpu"]["loadgen"]["processes"] >= 1 and r["cpu"]["loadgen"]["cpu_s"] >= 0, (config, r["cpu"])
        # The whole machine was busy at least as long as the measured groups, within a tick per process.
        measured = sum(r["cpu"][g]["cpu_s"] for g in groups)
        slack = sum(r["cpu"][g]["processes"] for g in groups) / cpu.CLOCK_TICKS
        assert r["machine"]["busy_s"] >= measured - slack - 0.05, r["cpu"]
        assert 0 <= r["machine"]["idle_pct"] <= 100
    assert sum(rows[c]["cpu"]["loadgen"]["cpu_s"] for c in expected) > 0
    workers = report["settings"]["shim_workers"]
    for t in transports:
        cpu_groups = rows[f"shim-{t}"]["cpu"]
        assert cpu_groups["shim"]["processes"] == workers + 1  # gunicorn's master and its workers
        assert cpu_groups["triton"]["processes"] >= 2  # tritonserver and its python-backend stubs
    assert rows["legacy-front"]["cpu"]["legacy"]["processes"] == report["settings"]["legacy_workers"] + 1
    for t in transports:  # the split by the shim's own counters: one thread's clock holds its stages
        split = cpu_split(rows[f"shim-{t}"])
        assert split is not None, rows[f"shim-{t}"]["breakdown"]
        if t == "encoded":  # the uploads went to Triton as they came: nothing decoded in the shim
            assert split["decode"] == 0 and split["preprocess"] == 0 and split["batch senders"] > 0, (t, split)
            continue
        assert split["decode"] > 0 and split["preprocess"] > 0 and split["batch senders"] > 0, (t, split)
        # Requests that straddle the window's edges count stages without their request or the reverse; a
        # request clock that missed its stages would be short by all of decode + preprocess.
        assert split["rest of request"] > -0.2 * (split["decode"] + split["preprocess"]), (t, split)


KINDS = ("floor", "flask", "legacy", "shim", "proxied", "direct")  # the table's order of rows


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_front_end_report_parses(quick_run: Run) -> None:
    out, report, elapsed = quick_run
    lines = (out / "results.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| row | transport |"))
    table = lines[header + 2:header + 2 + len(report["results"])]
    assert len(table) == len(report["results"]) and lines[header + 2 + len(table)] == ""
    assert [line.split(" | ")[0].lstrip("| ") for line in table] == [
        r["label"] for r in sorted(report["results"], key=lambda r: KINDS.index(r["kind"]))]
    checks = [line.strip() for line in lines if line.strip().startswith(("PASS", "NOT MET", "n/a"))]
    host = [c for c in checks if "16-core GPU host" in c]
    front = [r["cpu_ms_per_image"].get("triton") for r in report["results"] if r["kind"] == "direct"]
    encoded = [r for r in report["results"] if r["kind"] in ("shim", "proxied") and r["transport"] == "encoded"]
    # 4 targets + an estimate per encoded row, which needs Triton's CPU in the direct row (a 1.3 s window may
    # count 0 ticks); the row behind nginx first, with nginx's CPU counted
    assert len(host) == (len(encoded) if any(front) else 0) and len(checks) == 4 + len(host), lines
    assert all("target >= 10,000" in line for line in host), host
    if host and len(encoded) == 2:
        assert "as deployed, behind nginx" in host[0] and " + nginx " in host[0], host
    (level,) = report["ratios"]
    transports = report["settings"]["transports"]
    assert level["best_transport"] in transports and len(level["transports"]) == len(transports)
    assert all(c["value"] is not None and c["met"] in (True, False) for c in level["checks"]), level
    (encoded,) = report["encoded_checks"]  # shim CPU per image, encoded against the tensor transport (fp32)
    assert encoded["best_tensor_transport"] == "fp32" and encoded["met"] in (True, False)
    assert any(line.startswith(f"c={CLIENTS}: ") and "with encoded / with the best tensor transport (fp32)" in line
               for line in lines), lines
    print(f"bench --frontend --quick took {elapsed:.0f} s")


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_wrk_measures_each_shim_row_again_in_the_same_run(quick_run: Run) -> None:
    out, report, _ = quick_run
    if shutil.which("wrk") is None:
        if os.environ.get("CI"):
            pytest.fail("wrk is missing: bench/wrk.py installs it with apt-get when run as root")
        pytest.skip("wrk is missing (apt-get install wrk)")
    for r in (r for r in report["results"] if r["kind"] == "shim"):
        checked = r["wrk"]
        assert checked["exit"] == 0 and checked["requests"] > 0, checked
        assert checked["non_2xx"] == 0 and checked["socket_errors"] == 0, checked
        assert checked["cpu_ms_per_image"]["shim"] > 0 and checked["cpu_ms_per_image"]["triton"] > 0, checked
    text = (out / "results.md").read_text()
    assert "| images/s (Python) | images/s (wrk) |" in text and "GPU host (estimate)" in text
