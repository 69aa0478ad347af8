"""The migration report's Markdown, HTML and CSV, from outcomes made here."""

from __future__ import annotations

import csv
import io
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from html import escape
from pathlib import Path

import pytest

from report.compare import LEGACY, TRITON, Agreement, Answer, Outcome, summarize
from report.render import CSV_COLUMNS, ROWS_LISTED, Report, html, markdown, results_csv, thumbnail_from, write
from report.svg import nice_step
from report.verdict import Thresholds, judge
from tests.sample_images import encode, photo
from tests.unit.test_report_verdict import outcome

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

HEADER = [("Source", "in-process: test"), ("Triton", "127.0.0.1:8000: triton server 2.51.0; versions served: 2")]


def report(outcomes: list[Outcome], folder: Path = Path("/data/capture"), **thresholds: float) -> Report:
    summary = summarize(outcomes)
    t = Thresholds(**thresholds)  # type: ignore[arg-type]
    return Report(started=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), seconds=12.5, folder=folder, header=HEADER,
                  thresholds=t, k=5, concurrency=1, warm_up=3, outcomes=outcomes, summary=summary,
                  verdict=judge(summary, t, k=5))


def mixed() -> list[Outcome]:
    return ([outcome(f"same-{i:02d}.jpg", diff=0.0) for i in range(20)]
            + [outcome("cat|dog.jpg", same=False, overlap=0.6, diff=0.41), outcome("close.png", overlap=0.8, diff=0.02)]
            + [outcome("down.jpg", triton_error="503 backend_unavailable: Triton is unreachable")]
            + [Outcome("2025-01-02T03-04-05-abc.json", skipped="invalid_image: not an image")])


def test_go_markdown_says_go_and_lists_every_check() -> None:
    text = markdown(report([outcome(f"{i}.jpg") for i in range(5)], max_p99_ratio=2))
    assert "**Verdict: GO**: every check passes." in text
    for name in ("top-1 agreement", "mean top-5 overlap", "p99 score difference",
                 "p99 latency ratio (Triton / legacy)", "errors"):
        assert re.search(rf"^\| {re.escape(name)} \|.*\| \*\*PASS\*\* \|$", text, re.M), name
    assert "| Triton | 127.0.0.1:8000: triton server 2.51.0; versions served: 2 |" in text
    assert "2025-01-02 03:04:05 UTC" in text


def test_no_go_markdown_names_the_failing_checks_and_the_disagreeing_files() -> None:
    text = markdown(report(mixed()))
    assert text.splitlines()[2].startswith("**Verdict: NO-GO**: 4 of 5 checks fail: top-1 agreement, mean top-5 "
                                           "overlap, p99 score difference, errors")
    disagreements = text.split("## Largest disagreements")[1].split("##")[0]
    assert disagreements.index("cat\\|dog.jpg") < disagreements.index("close.png")  # worst first, | escaped
    assert "same-00.jpg" not in disagreements  # identical answers are no disagreement
    assert "## Errors (1)" in text and "| down.jpg | triton | 503 backend_unavailable" in text
    assert "## Skipped inputs (1)" in text and "2025-01-02T03-04-05-abc.json" in text


def test_long_lists_are_cut_and_say_where_the_rest_is() -> None:
    outcomes = [Outcome(f"junk-{i}.txt", skipped="invalid_image") for i in range(ROWS_LISTED + 7)]
    outcomes.append(outcome("one.jpg"))
    text = markdown(report(outcomes))
    assert "And 7 more: results.csv lists each." in text
    assert text.count("| junk-") == ROWS_LISTED


def test_html_is_one_page_with_a_plot_each_and_nothing_from_outside(tmp_path: Path) -> None:
    page = html(report(mixed()))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    plots = re.findall(r"<svg\b.*?</svg>", page, re.S)
    titles = [ET.fromstring(p).findtext("title") for p in plots]  # each is well-formed XML
    assert titles == ["Agreement: top-5 overlap per image, and top-1", "Largest score difference per image",
                      "Latency per call, cumulative"]
    y_labels = ["images", "images", "share of calls at or below"]
    x_labels = ["classes of legacy's top-5 that Triton's top-5 holds", "largest |probability difference| of an image",
                "milliseconds"]
    for plot, x_label, y_label in zip(plots, x_labels, y_labels, strict=True):  # labelled axes
        assert re.search(rf'rotate\(-90[^>]*>{re.escape(y_label)}</text>', plot), plot
        assert escape(x_label) in plot
    assert not re.search(r"https?://", page), re.findall(r".{40}https?://.{40}", page)
    assert not re.search(r"<(script|link|iframe|object)\b", page)
    assert not re.search(r"""(src|href)\s*=\s*["']?(?!data:)[a-z]+:""", page)  # only data: URIs
    assert 'class="verdict NO-GO"' in page and "cat|dog.jpg" in page


def test_html_shows_thumbnails_of_the_disagreeing_images_as_data_uris(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "flip.jpg").write_bytes(encode(photo(300, 200, seed=1)))
    outcomes = [outcome("sub/flip.jpg", same=False, diff=0.5), outcome("gone.jpg", same=False, diff=0.4)]
    page = html(report(outcomes, tmp_path), thumbnail_from(tmp_path))
    (uri,) = re.findall(r'<img class="thumb" alt="" src="(data:image/jpeg;base64,[A-Za-z0-9+/=]+)">', page)
    assert len(uri) < 20_000  # a thumbnail, not the image


def test_plots_of_a_run_that_compared_nothing_still_render() -> None:
    outcomes = [outcome("down.jpg", triton_error="503 backend_unavailable: down")]
    page = html(report(outcomes))
    plots = re.findall(r"<svg\b.*?</svg>", page, re.S)
    assert len(plots) == 3 and all(ET.fromstring(p) is not None for p in plots)
    assert "not compared (an error)" in page and "triton: no samples" in page
    assert "No image was compared." in markdown(report(outcomes))


def test_csv_has_one_row_per_file_with_both_answers() -> None:
    outcomes = mixed()
    rows = list(csv.DictReader(io.StringIO(results_csv(outcomes))))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == len(outcomes)
    by_name = {r["file"]: r for r in rows}
    assert by_name["cat|dog.jpg"]["status"] == "compared" and by_name["cat|dog.jpg"]["same_top1"] == "0"
    assert by_name["cat|dog.jpg"]["legacy_class_id"] == "1" and by_name["cat|dog.jpg"]["triton_class_id"] == "2"
    assert float(by_name["same-00.jpg"]["legacy_ms"]) == pytest.approx(10)
    assert by_name["down.jpg"]["status"] == "error" and by_name["down.jpg"]["triton_ms"] == ""
    assert by_name["down.jpg"]["triton_error"].startswith("503")
    assert by_name["2025-01-02T03-04-05-abc.json"]["status"] == "skipped"


def test_write_puts_three_files_in_the_folder(tmp_path: Path) -> None:
    paths = write(report([outcome("a.jpg")], tmp_path), tmp_path / "out" / "deeper")
    assert sorted(p.name for p in paths.values()) == ["report.html", "report.md", "results.csv"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())


def test_nice_steps() -> None:
    assert [nice_step(x) for x in (10, 12, 100, 0.3, 7)] == [2, 5, 20, 0.1, 2]
    assert nice_step(0) == 1


def test_identical_answers_are_listed_as_no_disagreement() -> None:
    outcomes = [Outcome(f"{i}.jpg", legacy=Answer(LEGACY, 0.01), triton=Answer(TRITON, 0.01),
                        agreement=Agreement(True, 1.0, 0.0)) for i in range(3)]
    assert "No compared image has answers that differ at all." in markdown(report(outcomes))
