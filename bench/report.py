"""Turn measured runs into the numbers, the markdown tables and the plot of a benchmark report."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import Outcome

# The table that sold the migration: RTX 3090, ResNet-50, 224x224; the article does not state its concurrency.
SEED_SOURCE = "article: RTX 3090, ResNet-50, 224x224"
SEED_ROWS: tuple[dict[str, Any], ...] = (
    {"config": "legacy", "label": "Flask, single process", "qps": 78, "p99_ms": 210},
    {"config": "triton-instances", "label": "Triton, 2 instances", "qps": 315, "p99_ms": 89},
    {"config": "triton-batching", "label": "Triton, dynamic batching", "qps": 483, "p99_ms": 112},
)
ORDER = ("legacy", "triton-instances", "triton-batching", "direct")
NUMBER = {"direct": 0, "legacy": 1, "triton-instances": 2, "triton-batching": 3}


def summarize(outcome: Outcome) -> dict[str, Any]:
    """QPS and latency percentiles of the answers that completed inside the measured window.

    Errors are counted, by kind, and left out of QPS and latency: a fast 503 is not a fast answer.
    """
    window = outcome.window_s
    measured = [i for i, end in enumerate(outcome.ends) if 0 <= end < window]
    good = [outcome.latencies[i] * 1000 for i in measured if not outcome.errors[i]]
    kinds = Counter(outcome.errors[i] for i in measured if outcome.errors[i])
    warmup = [i for i, end in enumerate(outcome.ends) if end < 0]
    p50, p95, p99 = (float(v) for v in np.percentile(good, [50, 95, 99])) if good else (None, None, None)
    return {
        "answers": len(good),
        "errors": sum(kinds.values()),
        "error_kinds": dict(kinds),
        "warmup_answers": len(warmup),
        "warmup_errors": sum(1 for i in warmup if outcome.errors[i]),
        "unfinished": outcome.unfinished,
        "window_s": window,
        "qps": len(good) / window if window else 0.0,
        "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
        "mean_ms": float(np.mean(good)) if good else None,
        "max_ms": float(np.max(good)) if good else None,
        "loadgen_cpu_pct": 100 * outcome.cpu_s / window if window else None,
        "loadgen_cpu_ms_per_request": 1000 * outcome.cpu_s / len(measured) if measured else None,
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def ordered(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (ORDER.index(r["config"]), r["concurrency"]))


def results_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [_row(["source", "configuration", "clients", "QPS", "p50 ms", "p95 ms", "p99 ms", "errors", "answers"]),
             _row(["---", "---", "--:", "--:", "--:", "--:", "--:", "--:", "--:"])]
    for seed in SEED_ROWS:
        lines.append(_row([SEED_SOURCE, seed["label"], "?", seed["qps"], "-", "-", seed["p99_ms"], "-", "-"]))
    for r in ordered(rows):
        lines.append(_row(["this run", r["label"], r["concurrency"], _f(r["qps"]), _f(r["p50_ms"]), _f(r["p95_ms"]),
                           _f(r["p99_ms"]), r["errors"], r["answers"]]))
    return lines


def _by(rows: Sequence[dict[str, Any]], config: str) -> dict[int, dict[str, Any]]:
    return {r["concurrency"]: r for r in rows if r["config"] == config}


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: the shim's QPS against the direct ceiling, and its p99 and QPS against the legacy app."""
    shim, direct, legacy = _by(rows, "triton-batching"), _by(rows, "direct"), _by(rows, "legacy")
    out = []
    for c in sorted(shim):
        s = shim[c]
        d, lg = direct.get(c), legacy.get(c)
        out.append({
            "concurrency": c,
            "shim_vs_direct_qps": s["qps"] / d["qps"] if d and d["qps"] else None,
            "shim_vs_legacy_qps": s["qps"] / lg["qps"] if lg and lg["qps"] else None,
            "shim_vs_legacy_p99": s["p99_ms"] / lg["p99_ms"] if lg and lg["p99_ms"] and s["p99_ms"] else None,
        })
    return out


def ratios_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [_row(["clients", "QPS (3) shim / (0) direct", "QPS (3) shim / (1) legacy", "p99 (3) shim / (1) legacy"]),
             _row(["--:", "--:", "--:", "--:"])]
    for r in ratios(rows):
        lines.append(_row([r["concurrency"], _f(r["shim_vs_direct_qps"], 2), _f(r["shim_vs_legacy_qps"], 2),
                           _f(r["shim_vs_legacy_p99"], 2)]))
    return lines


def breakdown_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [_row(["configuration", "clients", "client mean", "in shim", "decode", "preprocess", "shim queue",
                   "infer /batch", "postprocess", "shim batch", "Triton queue", "Triton compute", "Triton batch",
                   "load gen CPU", "load avg"]),
             _row(["---", *["--:"] * 14])]
    for r in ordered(rows):
        s, t = r["breakdown"].get("shim") or {}, r["breakdown"].get("triton") or {}
        compute = None
        if t.get("compute_infer_ms") is not None:
            compute = sum(t.get(k) or 0.0 for k in ("compute_input_ms", "compute_infer_ms", "compute_output_ms"))
        lines.append(_row([
            r["label"], r["concurrency"], _f(r["mean_ms"]), _f(s.get("request_ms")), _f(s.get("decode_ms")),
            _f(s.get("preprocess_ms")), _f(s.get("queue_ms")), _f(s.get("infer_ms")), _f(s.get("postprocess_ms")),
            _f(s.get("mean_batch")), _f(t.get("queue_ms")), _f(compute), _f(t.get("mean_batch")),
            f"{_f(r['loadgen_cpu_pct'])} %",
            f"{_f(r.get('load_average_before'))} / {_f(r.get('load_average_after'))}"]))
    return lines


def ceiling_table(ceiling: Sequence[dict[str, Any]]) -> list[str]:
    lines = [_row(["request", "clients", "req/s against the stub", "errors", "load gen CPU ms per request"]),
             _row(["---", "--:", "--:", "--:", "--:"])]
    for r in ceiling:
        lines.append(_row([r["request"], r["concurrency"], _f(r["qps"], 0), r["errors"],
                           _f(r["loadgen_cpu_ms_per_request"], 3)]))
    return lines


def markdown(report: dict[str, Any]) -> str:
    rows, m = report["results"], report["machine"]
    gpus = ", ".join(g["name"] for g in m["gpus"]) or "none"
    s = report["settings"]
    lines = [
        f"# Benchmark: {report['model']['arch']} ({report['model']['source']})",
        "",
        f"`{report['command']}`, {report['started']}, {report['elapsed_s']:.0f} s.",
        "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gib']} GiB, GPU: {gpus}; "
        f"Python {m['python']}, torch {m['packages'].get('torch')}, tritonclient {m['packages'].get('tritonclient')}"
        + (f", Triton server {m['triton_server']['version']}" if m.get("triton_server") else "")
        + f"; load average (1 min) {m['load_average'][0]} at start, {m['load_average_end'][0]} at the end; "
        f"git {m['git']}.",
        "",
        f"Closed loop, {s['warmup_s']:g} s warm-up (discarded) then {s['duration_s']:g} s measured per row; "
        f"each client sends one of {s['images']} different {s['image_size']} JPEGs as a multipart upload "
        "(direct: the same images as ready-made FP32 [1,3,224,224] tensors). QPS counts good answers; "
        "latencies are per request, end to end, good answers only.",
        "",
        "## Throughput and latency",
        "",
        *results_table(rows),
        "",
        "Configurations:",
        "",
        *[f"- {c['label']}: {c['description']}" for c in report["configurations"]],
        *[f"- skipped {k}: {v}" for k, v in report["skipped"].items()],
        "",
        "## Ratios",
        "",
        *ratios_table(rows),
        "",
        "## Where the time goes",
        "",
        "Means over each measured run, in ms, from the shim's /metrics and Triton's metrics (deltas over the run). "
        "`client mean` is what the load generator saw; `in shim` is the shim's own request timer, the rest is "
        "HTTP and waiting for a gunicorn thread. `shim queue` is the wait in the shim's batcher, `infer /batch` "
        "one Triton round trip per batch; `Triton queue` and `Triton compute` are per request inside Triton "
        "(a batched request counts its whole batch's compute); batches are images per call. `load gen CPU` is the "
        "load generator's own CPU time over the run, in % of one core; `load avg` is the machine's 1-minute load "
        "average before / after the run, where other work on the machine shows.",
        "",
        *breakdown_table(rows),
        "",
        "## The load generator's own ceiling",
        "",
        "The same requests against a stub server that reads each one whole and answers `ok` (both on this "
        f"machine, so this is a lower bound), {report['ceiling_duration_s']:g} s per row, "
        f"{report['settings']['loadgen_processes']} load generator process(es):",
        "",
        *ceiling_table(report["loadgen_ceiling"]),
        "",
    ]
    if report.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_qps, ax_p99) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    levels = sorted({r["concurrency"] for r in rows})
    for config in ORDER:
        series = sorted((r for r in rows if r["config"] == config), key=lambda r: r["concurrency"])
        if not series:
            continue
        xs = [r["concurrency"] for r in series]
        style = "--" if config == "direct" else "-"
        ax_qps.plot(xs, [r["qps"] for r in series], style, marker="o", label=series[0]["label"])
        ax_p99.plot(xs, [r["p99_ms"] if r["p99_ms"] is not None else np.nan for r in series], style, marker="o",
                    label=series[0]["label"])
    for ax, ylabel in ((ax_qps, "throughput (good answers/s)"), (ax_p99, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax_p99.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
