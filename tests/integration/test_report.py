"""shim-report end to end: the real command against the real Triton, and a dead one."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devstack import EmbeddedTriton, promtext
from tests.conftest import TEST_ARCH, make_test_repo, start_triton
from tests.support import ROOT, encode, free_ports, photo

IMAGE_COUNT = 12
# Latency is the benchmark's business (docs/testing.md): the runs here judge answers, not this shared machine's speed.
ANY_SPEED = ["--max-p99-ratio", "1000"]


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as a capture leaves it: uploads named <time>-<request id>, some sidecars, a broken upload."""
    folder = tmp_path_factory.mktemp("capture")
    (folder / "2025-01-02").mkdir()
    for i in range(IMAGE_COUNT):
        fmt, ext = ("PNG", "png") if i % 5 == 4 else ("JPEG", "jpg")
        where = folder / "2025-01-02" if i % 4 == 3 else folder
        stem = f"20250102T0304{i:02d}Z-req{i:03d}"
        (where / f"{stem}.{ext}").write_bytes(encode(photo(96 + 8 * i, 72, seed=700 + i), fmt))
        if i < 3:
            (where / f"{stem}.json").write_text(json.dumps({"request_id": f"req{i:03d}", "status": 200}))
    (folder / "20250102T030499Z-broken.jpg").write_bytes(encode(photo(96, 72, seed=1))[:300])  # a cut upload
    return folder


def run_report(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """The command as a pipeline runs it, with no SHIM_* setting of the test run leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_")}
    return subprocess.run([sys.executable, "-m", "report", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def in_process(triton_url: str, repo: Path, model_pt: Path) -> list[str]:
    return ["--triton-url", triton_url, "--legacy-model", str(model_pt),
            "--labels", str(repo / "resnet50" / "labels.txt")]


def results(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as f:
        return list(csv.DictReader(f))


def assert_one_clear_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("migration report: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_the_same_model_on_triton_is_a_go(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
                                          capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = run_report(str(capture), *in_process(triton.http_url, test_repo, test_model_pt), "--out", str(out),
                      *ANY_SPEED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out / "report.md")
    assert re.fullmatch(r"migration report: GO: 12 of 12 images compared, top-1 agreement 100%, errors 0, "
                        r"4 skipped; .*report\.html", done.stderr.strip()), done.stderr  # progress: not a terminal
    text = (out / "report.md").read_text()
    assert "**Verdict: GO**: every check passes." in text
    assert re.search(r"\| Triton \| 127\.0\.0\.1:\d+: triton server \d+\.\d+\.\d+; model 'resnet50' \(python\), "
                     r"versions served: 1; transport ", text), text
    assert f"export info: arch {TEST_ARCH}, seed 0" in text and "one image per call (batch size 1)" in text
    assert "| Images | 16 files under" in text and "4 skipped inputs" in text
    rows = results(out)
    assert len(rows) == 16
    compared = [r for r in rows if r["status"] == "compared"]
    assert len(compared) == IMAGE_COUNT and all(r["same_top1"] == "1" for r in compared)
    assert all(float(r["max_score_diff"]) <= 1e-5 for r in compared)  # the same weights on both paths
    skipped = {r["file"] for r in rows if r["status"] == "skipped"}
    assert skipped == {"20250102T030400Z-req000.json", "20250102T030401Z-req001.json",
                       "20250102T030402Z-req002.json", "20250102T030499Z-broken.jpg"}
    page = (out / "report.html").read_text()
    assert len(re.findall(r"<svg\b", page)) == 3 and "GO" in page


def test_the_encoded_transport_sends_each_upload_as_it_came_and_is_a_go(triton: EmbeddedTriton, test_repo: Path,
                                                                        test_model_pt: Path, capture: Path,
                                                                        tmp_path: Path) -> None:
    """--transport encoded: Triton decodes the JPEGs itself (resnet50_encoded), the PNGs go as tensors."""
    out = tmp_path / "report"
    before = sum(s.value for s in promtext.scrape(triton.metrics_url)
                 if s.matches("nv_inference_count", {"model": "resnet50_encoded"}))
    done = run_report(str(capture), *in_process(triton.http_url, test_repo, test_model_pt), "--out", str(out),
                      "--transport", "encoded", "--warm-up", "1", *ANY_SPEED)
    assert done.returncode == 0, done.stderr
    assert "GO: 12 of 12 images compared" in done.stderr, done.stderr
    assert "transport encoded" in (out / "report.md").read_text()
    after = sum(s.value for s in promtext.scrape(triton.metrics_url)
                if s.matches("nv_inference_count", {"model": "resnet50_encoded"}))
    assert after - before == 10 + 1  # the 10 JPEGs and the warm-up call; the 2 PNGs went as tensors
    assert all(float(r["max_score_diff"]) <= 1e-3 for r in results(out) if r["status"] == "compared")


def test_triton_serving_another_version_is_a_no_go_that_names_the_images(
        test_model_pt: Path, seed1_model_pt: Path, capture: Path, tmp_path: Path) -> None:
    repo = make_test_repo(tmp_path / "repo", test_model_pt, only_resnet50=True)  # tensors over HTTP
    (repo / "resnet50" / "2").mkdir()
    (repo / "resnet50" / "2" / "model.pt").symlink_to(seed1_model_pt)
    other = start_triton(repo, tmp_path / "cache")  # serves version 2 only: other weights than the legacy model
    try:
        out = tmp_path / "report"
        done = run_report(str(capture), *in_process(other.http_url, repo, test_model_pt), "--transport", "fp32",
                          "--out", str(out), "--concurrency", "2", *ANY_SPEED)
    finally:
        other.stop(graceful=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().startswith("migration report: NO-GO (failed: "), done.stderr
    text = (out / "report.md").read_text()
    assert text.splitlines()[2].startswith("**Verdict: NO-GO**")
    assert "versions served: 2;" in text
    assert re.search(r"^\| p99 score difference \|.*\| \*\*FAIL\*\* \|$", text, re.M), text
    differs = sorted(r["file"] for r in results(out) if r["same_top1"] == "0")
    assert differs, "other weights should change some top-1 answers"
    listed = text.split("## Largest disagreements")[1].split("\n## ")[0]
    named = [name for name in differs if f"| {name} |" in listed]
    assert len(named) == min(len(differs), 10), (differs, listed)


@pytest.mark.parametrize("kind", ["closed port", "accepts and never answers"])
def test_a_dead_triton_is_one_clear_line_and_exit_2(kind: str, test_repo: Path, test_model_pt: Path, capture: Path,
                                                     tmp_path: Path) -> None:
    with socket.socket() as silent:
        if kind == "closed port":
            (port,) = free_ports(1)
        else:
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)
            port = silent.getsockname()[1]
        done = run_report(str(capture), *in_process(f"127.0.0.1:{port}", test_repo, test_model_pt),
                          "--out", str(tmp_path / "report"), timeout_s=60)
    assert done.returncode == 2, done.stderr
    line = assert_one_clear_line(done)
    assert f"Triton cannot be used: Triton model 'resnet50' at 127.0.0.1:{port}" in line
    assert ("unreachable" if kind == "closed port" else "did not answer within") in line
    assert not (tmp_path / "report").exists()
