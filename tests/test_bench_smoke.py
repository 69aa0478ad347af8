"""`python -m bench --quick` end to end, as `make bench-quick` runs it: no assertion on speed.

Every configuration must answer every request it was sent, the Triton variants must be what they claim
(read back from Triton itself), the breakdown must come from real metrics, and the report's files parse.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.support import ROOT

pytestmark = pytest.mark.triton

CONFIGS = {"legacy", "triton-instances", "triton-batching", "direct"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "out"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(300)
def test_every_configuration_answers_without_errors(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, report = quick_run
    rows, levels = report["results"], report["settings"]["concurrency"]
    assert len(levels) >= 2
    assert sorted((r["config"], r["concurrency"]) for r in rows) == sorted((c, n) for c in CONFIGS for n in levels)
    for r in rows:
        assert (r["errors"], r["warmup_errors"], r["unfinished"]) == (0, 0, 0), r
        assert r["answers"] > 0 and r["warmup_answers"] > 0, r
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"], r
        assert r["qps"] == pytest.approx(r["answers"] / r["window_s"])
    assert report["skipped"] == {}
    machine = report["machine"]
    assert machine["cpu"] and machine["usable_cores"] >= 1 and machine["packages"]["torch"]
    assert machine["triton_server"]["version"]


@pytest.mark.timeout(300)
def test_triton_variants_and_breakdown_come_from_the_servers(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, report = quick_run
    served = report["triton_configs"]  # each variant as Triton itself reports it
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


@pytest.mark.timeout(300)
def test_report_files_parse(quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, report = quick_run
    lines = (out / "results.md").read_text().splitlines()
    header = lines.index("| source | configuration | clients | QPS | p50 ms | p95 ms | p99 ms | errors | answers |")
    table = lines[header + 2:header + 2 + 3 + len(report["results"])]
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
