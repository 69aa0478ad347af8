"""The report as Markdown, one self-contained HTML page (inline SVG, thumbnails as data: URIs) and results.csv;
both documents render the same list of sections, so they never say different things."""

from __future__ import annotations

import base64
import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from html import escape
from pathlib import Path

from PIL import Image

from report import svg
from report.compare import BACKENDS, LEGACY, TRITON, Answer, Outcome, Summary, worst
from report.percentiles import percentile
from report.verdict import Thresholds, Verdict, percent

WORST_LISTED = 10
ROWS_LISTED = 50  # errors and skipped inputs: results.csv has every one
COLORS = {LEGACY: "#4e79a7", TRITON: "#76b900"}


@dataclass(frozen=True)
class Report:
    started: datetime
    seconds: float
    folder: Path
    header: list[tuple[str, str]]  # InProcess.describe()
    thresholds: Thresholds
    k: int
    concurrency: int
    warm_up: int  # uncounted calls per backend before the run
    outcomes: list[Outcome]
    summary: Summary
    verdict: Verdict


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # SVG, HTML only
    thumbnails: list[str] = field(default_factory=list)  # file names whose row shows the image, HTML only
    after: list[str] = field(default_factory=list)  # paragraphs after the table


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def _top1(answer: Answer | None) -> str:
    if answer is None or not answer.top:
        return "n/a"
    best = answer.top[0]
    return f"{best.label} ({best.class_id}) {best.score:.3f}"


def sections(report: Report) -> list[Section]:
    s, t, k = report.summary, report.thresholds, report.k
    verdict = report.verdict
    compared_note = "" if s.compared == s.images else f" ({s.images - s.compared} not compared: a backend failed)"
    what = Section("What was compared", headers=["", ""], rows=[
        ["When", f"{report.started:%Y-%m-%d %H:%M:%S %Z} (took {report.seconds:.1f} s)"],
        *[[name, value] for name, value in report.header],
        ["Images", f"{_n(s.files, 'file')} under {report.folder}: {_n(s.images, 'image')}{compared_note}, "
                   f"{_n(s.skipped, 'skipped input')} (not images the shim reads)"],
        ["Concurrency", f"{_n(report.concurrency, 'image')} at a time; each image asks both backends one after the "
                        "other, in alternating order, after "
                        f"{_n(report.warm_up, 'uncounted warm-up call')} per backend"],
        ["Thresholds", f"top-1 agreement >= {percent(t.min_top1_agreement)}, mean top-{k} overlap >= "
                       f"{percent(t.min_topk_overlap)}, p99 score difference <= {t.max_score_diff:g}, p99 latency "
                       f"ratio <= {t.max_p99_ratio:g}, errors <= {t.max_errors}"],
    ])
    checks = Section("Checks", headers=["check", "measured", "threshold", "result"],
                     rows=[[c.name, c.measured, c.threshold, f"**{c.result}**"] for c in verdict.checks])

    overlap_values = [i / k for i in range(k, -1, -1)]
    agreements = [o.agreement for o in report.outcomes if o.agreement is not None]

    def count(value: float, same: bool) -> float:
        return sum(abs(a.topk_overlap - value) < 1e-9 and a.same_top1 == same for a in agreements)

    not_compared = s.images - s.compared
    extra = [0.0] if not_compared else []  # a last bar for images a backend failed on
    categories = [f"{round(v * k)}/{k}" for v in overlap_values] + (["none"] if not_compared else [])
    bars = svg.stacked_bars(
        f"Agreement: top-{k} overlap per image, and top-1", categories,
        [svg.Series("top-1 same", "#59a14f", [count(v, True) for v in overlap_values] + extra),
         svg.Series("top-1 differs", "#e15759", [count(v, False) for v in overlap_values] + extra),
         svg.Series("not compared (an error)", "#bab0ac",
                    [0.0] * len(overlap_values) + [float(not_compared)] * bool(not_compared))],
        x_label=f"classes of legacy's top-{k} that Triton's top-{k} holds", y_label="images")
    histogram = svg.log_histogram(
        "Largest score difference per image", s.score_diffs, low_exp=-8, high_exp=0, bins_per_decade=2,
        x_label="largest |probability difference| of an image (log scale; the first bin holds 0)",
        y_label="images", marker=(t.max_score_diff, f"threshold {t.max_score_diff:g}"))
    share = f" ({percent(s.same_top1 / s.compared)})" if s.compared else ""
    overlap = percent(s.topk_overlap_mean) if s.topk_overlap_mean is not None else "n/a"
    agreement = Section("Agreement", plots=[bars, histogram], paragraphs=[
        f"Top-1 the same for {s.same_top1} of {s.compared} compared images{share}; mean top-{k} overlap {overlap}; "
        f"largest score difference per image: median {_g(percentile(s.score_diffs, 50))}, p99 {_g(s.score_diff_p99)}, "
        f"largest {_g(s.score_diff_max)}."])

    latency = Section("Latency", headers=["backend", "answered", "errors", "p50 ms", "p90 ms", "p99 ms", "max ms",
                                          "mean ms"])
    for backend in BACKENDS:
        lat = s.latency[backend]
        latency.rows.append([backend, str(len(lat.samples)), str(s.errors[backend]),
                             *(_ms(lat.percentile(p)) for p in (50, 90, 99, 100)), _ms(lat.mean)])
    fewest = min(len(s.latency[b].samples) for b in BACKENDS)
    latency.after.append("Percentiles are nearest-rank (report/percentiles.py) over the successful calls"
                         + (f"; with {fewest} calls, p99 is close to the largest one." if fewest < 100 else "."))
    latency.plots.append(svg.cdf("Latency per call, cumulative", [
        svg.Series(b, COLORS[b], s.latency[b].samples) for b in BACKENDS],
        x_label="milliseconds", y_label="share of calls at or below", unit_scale=1000, unit=" ms"))

    listed = worst(report.outcomes, WORST_LISTED)
    disagreements = Section(f"Largest disagreements ({len(listed)} listed, worst first)" if listed
                            else "Largest disagreements",
                            headers=["file", "legacy top-1", "Triton top-1", "top-1", f"top-{k} overlap",
                                     "largest score difference"])
    for o in listed:
        a = o.agreement
        assert a is not None
        disagreements.rows.append([o.name, _top1(o.legacy), _top1(o.triton), "same" if a.same_top1 else "**differs**",
                                   percent(a.topk_overlap), f"{a.max_score_diff:.2g}"])
        disagreements.thumbnails.append(o.name)
    if not listed:
        disagreements.paragraphs.append("No compared image has answers that differ at all." if s.compared
                                        else "No image was compared.")
    differs = [o.name for o in report.outcomes if o.agreement is not None and not o.agreement.same_top1]
    if len(differs) > len([o for o in listed if o.agreement and not o.agreement.same_top1]):
        disagreements.after.append(f"Top-1 differs for {len(differs)} images in all: results.csv lists each.")

    out = [what, checks, agreement, latency, disagreements]
    errors = [[o.name, a.backend, a.error or ""] for o in report.outcomes for a in (o.legacy, o.triton)
              if a is not None and not a.ok]
    skipped = [[o.name, o.skipped] for o in report.outcomes if o.skipped is not None]
    for title, rows, headers, paragraphs in [
            ("Errors", errors, ["file", "backend", "error"], []),
            ("Skipped inputs", skipped, ["file", "why"],
             ["Files that are not images the shim reads: neither backend was asked."])]:
        if rows:
            more = [f"And {len(rows) - ROWS_LISTED} more: results.csv lists each."] if len(rows) > ROWS_LISTED else []
            out.append(Section(f"{title} ({len(rows)})", paragraphs, headers, rows[:ROWS_LISTED], after=more))
    out.append(Section("How to read this", paragraphs=[
        f"**Top-1 agreement**: the share of compared images whose best class is the same. **Top-{k} overlap**: the "
        f"share of legacy's top-{k} classes that Triton's top-{k} also holds, averaged over images. **Score "
        "difference**: per image, the largest difference of any class's probability between the two answers; the "
        "check uses the 99th percentile over images, so a threshold tolerates the same rare outliers the top-1 "
        "threshold does. **p99 latency ratio**: Triton's 99th percentile call time over legacy's, measured on the "
        "same machine in the same run. **Errors**: failed calls of either backend, including a shim's fallback to "
        "legacy on a request for Triton."]))
    return out


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _g(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2g}"


def _verdict_line(verdict: Verdict) -> str:
    if verdict.go:
        return "every check passes"
    return f"{len(verdict.failed)} of {len(verdict.checks)} checks fail: {', '.join(verdict.failed)}"


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(report: Report) -> str:
    lines = ["# Migration report: legacy -> Triton", "",
             f"**Verdict: {report.verdict.label}**: {_verdict_line(report.verdict)}.", ""]
    for section in sections(report):
        lines += [f"## {section.title}", "", *[x for p in section.paragraphs for x in (p, "")]]
        if section.rows:
            lines.append("| " + " | ".join(_md_cell(h) for h in section.headers) + " |")
            lines.append("|" + "---|" * len(section.headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in section.rows]
            lines.append("")
        lines += [x for p in section.after for x in (p, "")]
        if section.plots:
            lines += ["(Plots: report.html.)", ""]
    return "\n".join(lines)


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
.verdict { font-size: 1.6em; font-weight: bold; padding: 0.4em 0.8em; display: inline-block; border-radius: 6px; }
.GO { background: #d9f2d0; color: #1d5e12; } .NO-GO { background: #f9d4d4; color: #8a1212; }
.PASS { color: #1d5e12; font-weight: bold; } .FAIL { color: #8a1212; font-weight: bold; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
img.thumb { max-width: 96px; max-height: 96px; }
"""


def _inline(text: str) -> str:
    """Markdown's **bold** as <b>, the rest escaped."""
    parts = escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def html(report: Report, thumbnail: Callable[[str], str | None] | None = None) -> str:
    """One page; `thumbnail(file name)` gives a data: URI for the images of the disagreement table."""
    v = report.verdict
    body = ["<h1>Migration report: legacy &rarr; Triton</h1>",
            f'<p><span class="verdict {v.label}">{v.label}</span> {escape(_verdict_line(v))}.</p>']
    for section in sections(report):
        body.append(f"<h2>{escape(section.title)}</h2>")
        body += [f"<p>{_inline(p)}</p>" for p in section.paragraphs]
        if section.plots:
            body.append('<div class="plots">' + "\n".join(section.plots) + "</div>")
        if section.rows:
            thumbs = section.thumbnails if thumbnail is not None else []
            heads = ([""] if thumbs else []) + section.headers
            body.append("<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in heads) + "</tr>")
            for i, row in enumerate(section.rows):
                cells = []
                if thumbs and thumbnail is not None:
                    uri = thumbnail(thumbs[i]) if i < len(thumbs) else None
                    cells.append(f'<img class="thumb" alt="" src="{uri}">' if uri else "")
                for cell in row:
                    css = f' class="{cell.strip("*")}"' if cell.strip("*") in ("PASS", "FAIL") else ""
                    cells.append(f"<span{css}>{_inline(cell)}</span>" if css else _inline(cell))
                body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            body.append("</table>")
        body += [f"<p>{_inline(p)}</p>" for p in section.after]
    title = f"Migration report {report.started:%Y-%m-%d %H:%M} - {v.label}"
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def thumbnail_from(folder: Path, size: int = 96) -> Callable[[str], str | None]:
    """Thumbnails of files under `folder` as data: URIs (JPEG); None for a file that no longer decodes."""
    def make(name: str) -> str | None:
        try:
            with Image.open(folder / name) as image:
                image.thumbnail((size, size))
                buffer = io.BytesIO()
                image.convert("RGB").save(buffer, format="JPEG", quality=80)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            return None
        return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    return make


CSV_COLUMNS = ["file", "status", "same_top1", "topk_overlap", "max_score_diff",
               "legacy_class_id", "legacy_label", "legacy_score", "triton_class_id", "triton_label", "triton_score",
               "legacy_ms", "triton_ms", "legacy_error", "triton_error", "skipped"]


def results_csv(outcomes: Sequence[Outcome]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for o in outcomes:
        a = o.agreement
        status = "skipped" if o.skipped is not None else "compared" if a is not None else "error"
        row: list[object] = [o.name, status]
        row += ["", "", ""] if a is None else [int(a.same_top1), f"{a.topk_overlap:.4f}", f"{a.max_score_diff:.3e}"]
        answers = (o.legacy, o.triton)
        for best in [a.top[0] if a is not None and a.top else None for a in answers]:
            row += ["", "", ""] if best is None else [best.class_id, best.label, f"{best.score:.6f}"]
        row += ["" if a is None or not a.ok or a.seconds is None else f"{a.seconds * 1000:.3f}" for a in answers]
        row += ["" if a is None or a.error is None else a.error for a in answers]
        row.append(o.skipped or "")
        writer.writerow(row)
    return buffer.getvalue()


def write(report: Report, out: Path) -> dict[str, Path]:
    """report.md, report.html and results.csv into `out` (made if needed); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "html": out / "report.html", "csv": out / "results.csv"}
    paths["markdown"].write_text(markdown(report), encoding="utf-8")
    paths["html"].write_text(html(report, thumbnail_from(report.folder)), encoding="utf-8")
    paths["csv"].write_text(results_csv(report.outcomes), encoding="utf-8")
    return paths
