"""`python -m bench --quick --both` end to end, in one process: no assertion on speed.

One invocation runs the Flask-vs-Triton configurations (one concurrency level, short windows) and then the
front-end rows (floor, legacy front, the shim per transport, direct), so that the models, images and load
generator are made once. Every row must answer every request it was sent, the Triton variants must be
what they claim (read back from Triton itself), the breakdown must come from real metrics, the CPU
columns must come from the real process trees, and the report's files parse. Plus the pure parts of the
CPU accounting and the profile summary, on made-up inputs.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench import cpu
from bench.profile import parse_raw, top
from tests.support import ROOT

# The Flask-vs-Triton configurations the smoke runs. (2) triton-instances costs a second Triton with torch
# stubs (about 15 s here); its variant's config is checked without a server below.
CONFIGS = ("legacy", "triton-batching", "direct")
# Two of the shim's transports: the FP32 path and the uint8 ensemble. The benchmark's code is the same for
# every transport (one setting in the shim's environment); the shim's own tests cover each transport.
TRANSPORTS = ("http", "uint8")
CLIENTS = 8
Run = tuple[Path, dict[str, Any], dict[str, Any], float]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("bench") / "out"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--both", "--configs", ",".join(CONFIGS),
                           "--concurrency", str(CLIENTS), "--warmup", "0.5", "--duration", "1.5",
                           "--legacy-workers", "1", "--transports", ",".join(TRANSPORTS), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    classic = json.loads((out / "results.json").read_text())
    front = json.loads((out / "frontend" / "results.json").read_text())
    return out, classic, front, elapsed


# -- the Flask-vs-Triton configurations -----------------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.timeout(300)
def test_every_configuration_answers_without_errors(quick_run: Run) -> None:
    _, report, _, _ = quick_run
    rows, levels = report["results"], report["settings"]["concurrency"]
    assert levels == [CLIENTS]
    assert sorted((r["config"], r["concurrency"]) for r in rows) == sorted((c, n) for c in CONFIGS for n in levels)
    for r in rows:
        assert (r["errors"], r["warmup_errors"], r["unfinished"]) == (0, 0, 0), r
        assert r["answers"] > 0, r  # (a 0.5 s warm-up may end before a loaded machine's first answer)
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"], r
        assert r["qps"] == pytest.approx(r["answers"] / r["window_s"])
    assert report["skipped"] == {}
    machine = report["machine"]
    assert machine["cpu"] and machine["usable_cores"] >= 1 and machine["packages"]["torch"]
    assert machine["triton_server"]["version"]


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_triton_variants_and_breakdown_come_from_the_servers(quick_run: Run) -> None:
    _, report, _, _ = quick_run
    served = report["triton_configs"]  # each variant as Triton itself reports it
    assert set(served) == set(CONFIGS) - {"legacy"}
    if "triton-instances" in served:
        assert "dynamic_batching" not in served["triton-instances"]
    assert served["triton-batching"]["dynamic_batching"]["preferred_batch_size"] == [8, 16, 32]
    for config in served.values():
        assert sum(int(g["count"]) for g in config["instance_group"]) == 2

    by = {(r["config"], r["concurrency"]): r for r in report["results"]}
    for (config, _), r in by.items():
        if config != "legacy":
            triton = r["breakdown"]["triton"]
            assert triton["requests"] > 0 and triton["compute_infer_ms"] > 0 and triton["failures"] == 0, r
        if config.startswith("triton-"):
            shim = r["breakdown"]["shim"]
            assert shim["requests"] > 0 and shim["decode_ms"] > 0 and shim["infer_ms"] > 0, r
            # The shim answered about what the load generator counted (its window includes the drain).
            assert shim["requests"] >= r["answers"] * 0.8, r
        if config == "triton-instances":  # no batching anywhere: the shim's batcher off, Triton's absent
            assert r["breakdown"]["shim"]["mean_batch"] == 1.0
            assert r["breakdown"]["triton"]["mean_batch"] == 1.0
    ceiling = report["loadgen_ceiling"]
    assert {c["request"].split(",")[0] for c in ceiling} == {"multipart JPEG", "FP32 tensor"}
    assert all(c["errors"] == 0 and c["qps"] > 0 for c in ceiling)


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_report_files_parse(quick_run: Run) -> None:
    out, report, _, _ = quick_run
    lines = (out / "results.md").read_text().splitlines()
    header = lines.index("| source | configuration | clients | QPS | p50 ms | p95 ms | p99 ms | errors | answers |")
    table = lines[header + 2:header + 2 + 3 + len(report["results"])]
    assert len(table) == 3 + len(CONFIGS)
    assert [line.split(" | ")[1] for line in table[:3]] == ["Flask, single process", "Triton, 2 instances",
                                                            "Triton, dynamic batching"]
    assert all(line.startswith("| this run |") for line in table[3:])
    assert lines[header + 2 + len(table)] == ""  # nothing else in the table

    with Image.open(out / "results.png") as image:
        assert image.format == "PNG" and image.width > 400 and image.height > 200
        image.verify()

    with (out / "requests.csv").open() as f:
        measured = Counter((row["config"], int(row["clients"])) for row in csv.DictReader(f)
                           if row["phase"] == "measure")
    for r in report["results"]:
        assert measured[(r["config"], r["concurrency"])] == r["answers"] + r["errors"]


# -- the front-end rows ---------------------------------------------------------------------------------------

def front_rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in report["results"]}


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_every_front_end_row_answers_without_errors(quick_run: Run) -> None:
    out, _, report, _ = quick_run
    rows = front_rows(report)
    transports = report["settings"]["transports"]
    assert transports == list(TRANSPORTS)
    assert set(rows) == {"floor", "legacy-front", *(f"shim-{t}" for t in transports), "direct-front"}
    for r in rows.values():
        assert (r["errors"], r["warmup_errors"], r["unfinished"]) == (0, 0, 0), r
        assert r["answers"] > 0, r
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], r
    for t in transports:
        row = rows[f"shim-{t}"]
        assert row["transport"] == t
        # A shim from before SHIM_TRANSPORT says nothing; one that knows it must run what it was asked.
        assert row["transport_reported"] in ("unknown", t), row
        assert row["breakdown"]["shim"]["requests"] > 0 and row["breakdown"]["triton"]["requests"] > 0
    # The near-free model was written into the run's folder, never into triton_repo.
    repo = Path(report["model"]["repository"])
    assert repo.is_relative_to(out) and "backend: \"python\"" in (repo / "resnet50" / "config.pbtxt").read_text()
    assert (ROOT / "triton_repo" / "resnet50" / "1" / "model.py").exists() is False


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_front_end_cpu_comes_from_the_process_trees(quick_run: Run) -> None:
    _, _, report, _ = quick_run
    rows = front_rows(report)
    usable = len(os.sched_getaffinity(0))
    floor = rows["floor"]
    assert floor["processes"] == usable == floor["cpu"]["floor"]["processes"]
    assert floor["cpu_ms_per_image"]["floor"] > 0
    transports = report["settings"]["transports"]
    expected = {"legacy-front": {"legacy", "loadgen"}, "direct-front": {"triton", "loadgen"},
                **{f"shim-{t}": {"shim", "triton", "loadgen"} for t in transports}}
    for config, groups in expected.items():
        r = rows[config]
        assert set(r["cpu"]) == groups | {"machine"}, r["cpu"]
        for group in groups:
            assert r["cpu"][group]["cpu_s"] > 0 and r["cpu_ms_per_image"][group] > 0, (config, group, r["cpu"])
        # The whole machine was busy at least as long as the measured groups, within a tick per process.
        measured = sum(r["cpu"][g]["cpu_s"] for g in groups)
        slack = sum(r["cpu"][g]["processes"] for g in groups) / cpu.CLOCK_TICKS
        assert r["machine"]["busy_s"] >= measured - slack - 0.05, r["cpu"]
        assert 0 <= r["machine"]["idle_pct"] <= 100
    workers = report["settings"]["shim_workers"]
    for t in transports:
        cpu_groups = rows[f"shim-{t}"]["cpu"]
        assert cpu_groups["shim"]["processes"] == workers + 1  # gunicorn's master and its workers
        assert cpu_groups["triton"]["processes"] >= 2  # tritonserver and its python-backend stubs
    assert rows["legacy-front"]["cpu"]["legacy"]["processes"] == report["settings"]["legacy_workers"] + 1


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_front_end_report_parses(quick_run: Run) -> None:
    out, _, report, elapsed = quick_run
    lines = (out / "frontend" / "results.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| row | transport |"))
    table = lines[header + 2:header + 2 + len(report["results"])]
    assert len(table) == len(report["results"]) and lines[header + 2 + len(table)] == ""
    assert [line.split(" | ")[0].lstrip("| ") for line in table] == [
        r["label"] for r in sorted(report["results"], key=lambda r: ("floor", "legacy", "shim", "direct").index(
            r["kind"]))]
    checks = [line.strip() for line in lines if line.strip().startswith(("PASS", "NOT MET", "n/a"))]
    assert len(checks) == 3, lines
    (level,) = report["ratios"]
    transports = report["settings"]["transports"]
    assert level["best_transport"] in transports and len(level["transports"]) == len(transports)
    assert all(c["value"] is not None and c["met"] in (True, False) for c in level["checks"]), level
    print(f"bench --quick --both took {elapsed:.0f} s")


def test_instances_variant_has_no_dynamic_batching(tmp_path: Path) -> None:
    """Configuration (2)'s repository, as bench/stack.py writes it for Triton: no batching, 2 instances."""
    from google.protobuf import text_format

    from app.embedded_triton.cpu_repo import read_config
    from bench import stack

    model_pt = tmp_path / "model.pt"
    model_pt.write_bytes(b"not read")
    for variant, batching in ((stack.Variant("instances", 2, dynamic_batching=False), False),
                              (stack.Variant("batching", 2, dynamic_batching=True), True)):
        repo = stack.variant_repo(tmp_path / "repos", variant, model_pt)
        config = read_config(repo / "resnet50" / "config.pbtxt")
        assert config.HasField("dynamic_batching") is batching, text_format.MessageToString(config)
        assert [g.count for g in config.instance_group] == [2]
        assert (repo / "resnet50" / "1" / "model.pt").resolve() == model_pt.resolve()


# -- the pure parts -------------------------------------------------------------------------------------------

def test_cpu_window_counts_new_and_exited_processes() -> None:
    # Group "g": 10 (root) -> 11 (alive throughout), 12 (exits, reaped by 10), 13 (appears).
    start = cpu.Snapshot({"g": {10: (100, 0), 11: (50, 0), 12: (30, 0)}})
    end = cpu.Snapshot({"g": {10: (110, 45), 11: (70, 0), 13: (5, 0)}})
    # 10: +10 own, +45 reaped (12's whole 45 ticks) ; 11: +20 ; 13: +5 from 0 ; 12 had 30 before the window.
    got = cpu.window_seconds(start, end)["g"]
    assert got["cpu_s"] == pytest.approx((10 + 45 + 20 + 5 - 30) / cpu.CLOCK_TICKS)
    assert (got["processes"], got["processes_at_start"]) == (3, 3)


def test_cpu_snapshot_reads_this_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); t = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(5)"])
    try:
        first = cpu.snapshot({"me": (os.getpid(),)})
        time.sleep(1.0)
        last = cpu.snapshot({"me": (os.getpid(),)})
        assert child.pid in last.groups["me"] and os.getpid() in last.groups["me"]
        assert cpu.window_seconds(first, last)["me"]["cpu_s"] > 0
    finally:
        child.kill()
        child.wait()


def test_profile_summary_ranks_own_and_total_time(tmp_path: Path) -> None:
    source = tmp_path / "worker.py"
    source.write_text("def run():\n    item = queue.get(block=True)\n    handle(item)\n")
    w = f"run ({source}:2)"  # a thread blocked in queue.get: waiting, whatever py-spy thought
    raw = (f"run ({source}:3);handle (/x/site-packages/app.py:5);decode (/x/app/pre.py:9) 60\n"
           f"run ({source}:3);handle (/x/site-packages/app.py:5) 30\n"
           f"run ({source}:3);handle (/x/site-packages/app.py:5);to_tensor (/x/app/pre.py:20) 10\n"
           f"{w} 50\n")
    stacks, samples = parse_raw(raw)
    assert samples == 150
    ranked = top(stacks, limit=2)
    assert (ranked["working_samples"], ranked["waiting_samples"]) == (100, 50)
    assert [(e["function"], e["own_pct"]) for e in ranked["by_own"]] == [("decode (app/pre.py)", 60.0),
                                                                          ("handle (app.py)", 30.0)]
    assert [(e["function"], e["total_pct"]) for e in ranked["by_total"]] == [("handle (app.py)", 100.0),
                                                                             (f"run ({source})", 100.0)]
