"""bench/perf_analyzer.py: Triton's own load generator, fetched hash-pinned from tritonclient's wheel, runs here
against the real Triton and gives a row that `make bench` can set beside its direct row."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import perf_analyzer
from devstack import EmbeddedTriton


@pytest.mark.triton
def test_perf_analyzer_installs_and_measures_the_session_triton(triton: EmbeddedTriton, tmp_path: Path) -> None:
    tool, why = perf_analyzer.find_or_install()
    assert tool is not None, why
    row = perf_analyzer.measure(tool, triton.http_url, "resnet50", concurrency=2, duration_s=1.5, out=tmp_path)
    assert row["concurrency"] == 2 and row["qps"] > 0, row
    assert 0 < row["p50_ms"] <= row["p99_ms"], row
    log = (tmp_path / "perf_analyzer-resnet50-c2.log").read_text()
    assert "Concurrency: 2" in log, log[-2000:]


@pytest.mark.triton
def test_a_model_triton_does_not_serve_is_an_error_that_says_so(triton: EmbeddedTriton, tmp_path: Path) -> None:
    tool, why = perf_analyzer.find_or_install()
    assert tool is not None, why
    with pytest.raises(RuntimeError, match="perf_analyzer exited"):
        perf_analyzer.measure(tool, triton.http_url, "no_such_model", concurrency=1, duration_s=1.5, out=tmp_path)


def test_without_the_package_index_the_rows_are_skipped_with_pips_reason(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens: a host without network
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    tool, why = perf_analyzer.find_or_install(tmp_path / "perf_analyzer")
    assert tool is None
    assert "pip download tritonclient==2.51.0" in why and "No matching distribution" in why, why
    assert not (tmp_path / "perf_analyzer").exists()  # nothing half-installed is taken for the tool next time
