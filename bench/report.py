"""Turn measured runs into the numbers, the markdown tables and the plot of a benchmark report."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.metrics import CPU_PARTS
from bench.loadgen import Outcome
from report.percentiles import percentile

# The table that sold the migration: RTX 3090, ResNet-50, 224x224; the article does not state its concurrency.
SEED_SOURCE = "article: RTX 3090, ResNet-50, 224x224"
SEED_ROWS: tuple[dict[str, Any], ...] = (
    {"config": "legacy", "label": "Flask, single process", "qps": 78, "p99_ms": 210},
    {"config": "triton-instances", "label": "Triton, 2 instances", "qps": 315, "p99_ms": 89},
    {"config": "triton-batching", "label": "Triton, dynamic batching", "qps": 483, "p99_ms": 112},
)
ORDER = ("legacy", "litserve", "triton-instances", "triton-batching", "direct")
NUMBER = {"direct": 0, "legacy": 1, "triton-instances": 2, "triton-batching": 3, "litserve": 4}
# Good answers each client has before the window opens, so that the window shows the steady state rather than the
# start: until then closed-loop clients are still settling into batches (bench/RESULTS.md, "The morning of 12-08").
SETTLED_ANSWERS = 3


def summarize(outcome: Outcome) -> dict[str, Any]:
    """QPS and latency percentiles of the good answers completed inside the window (a fast 503 is no answer)."""
    window = outcome.window_s
    measured = [i for i, end in enumerate(outcome.ends) if 0 <= end < window]
    good = [outcome.latencies[i] * 1000 for i in measured if not outcome.errors[i]]
    kinds = Counter(outcome.errors[i] for i in measured if outcome.errors[i])
    warmup = [i for i, end in enumerate(outcome.ends) if end < 0]
    p50, p95, p99 = (percentile(good, p) for p in (50, 95, 99))  # nearest rank: report/percentiles.py
    return {
        "answers": len(good),
        "errors": sum(kinds.values()),
        "error_kinds": dict(kinds),
        "warmup_answers": len(warmup),
        "warmup_errors": sum(1 for i in warmup if outcome.errors[i]),
        "warmup_answers_fewest": fewest_warmup_answers(outcome),
        "unfinished": outcome.unfinished,
        "window_s": window,
        "qps": len(good) / window if window else 0.0,
        "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
        "mean_ms": float(np.mean(good)) if good else None,
        "max_ms": float(np.max(good)) if good else None,
        "loadgen_cpu_pct": 100 * outcome.cpu_s / window if window else None,
        "loadgen_cpu_ms_per_request": 1000 * outcome.cpu_s / len(measured) if measured else None,
        "client_spread": client_spread(outcome, measured),
    }


def fewest_warmup_answers(outcome: Outcome) -> int | None:
    """The fewest good answers any client had before the window opened (None: no client sent anything)."""
    counts = dict.fromkeys(outcome.clients, 0)
    for client, end, error in zip(outcome.clients, outcome.ends, outcome.errors, strict=True):
        if end < 0 and not error:
            counts[client] += 1
    return min(counts.values()) if counts else None


def short_warmup_notes(rows: Sequence[dict[str, Any]], warmup_s: float) -> list[str]:
    """A note per row whose warm-up left a client with fewer than SETTLED_ANSWERS answers, with the warm-up that
    would give each client that many at the row's median latency."""
    notes = []
    for row in rows:
        fewest, p50 = row.get("warmup_answers_fewest"), row.get("p50_ms")
        if fewest is None or fewest >= SETTLED_ANSWERS or not p50:
            continue
        enough = 5 * math.ceil(SETTLED_ANSWERS * p50 / 1000 / 5)
        notes.append(f"{row['label']}, {row['concurrency']} clients: a client had {fewest} answer"
                     f"{'s' * (fewest != 1)} in the {warmup_s:g} s warm-up, so the window may still hold the start-up "
                     f"(clients not yet settled into their rhythm), its p99 most: `--warmup {enough}` or more "
                     "measures the steady state.")
    return notes


def client_spread(outcome: Outcome, measured: Sequence[int]) -> float | None:
    """The slowest client's mean latency over the fastest's, good answers in the window only: 1.0 when every
    client is served alike; a group of clients kept waiting behind one long batch shows as 2 or more."""
    by_client: dict[int, list[float]] = {}
    for i in measured:
        if not outcome.errors[i]:
            by_client.setdefault(outcome.clients[i], []).append(outcome.latencies[i])
    means = [sum(v) / len(v) for v in by_client.values()]
    if len(means) < 2 or min(means) <= 0:
        return None
    return max(means) / min(means)


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(names: Sequence[str], text: int = 1) -> list[str]:
    """A table's header and its alignment line: `text` left-aligned columns, then numbers."""
    return [_row(names), _row(["---"] * text + ["--:"] * (len(names) - text))]


def ordered(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (ORDER.index(r["config"]), r["concurrency"]))


def results_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = _head(["source", "configuration", "clients", "QPS", "p50 ms", "p95 ms", "p99 ms",
                   "slowest / fastest client", "errors", "answers"], 2)
    for seed in SEED_ROWS:
        lines.append(_row([SEED_SOURCE, seed["label"], "?", seed["qps"], "-", "-", seed["p99_ms"], "-", "-", "-"]))
    for r in ordered(rows):
        lines.append(_row(["this run", r["label"], r["concurrency"], _f(r["qps"]), _f(r["p50_ms"]), _f(r["p95_ms"]),
                           _f(r["p99_ms"]), _f(r.get("client_spread"), 2), r["errors"], r["answers"]]))
    return lines


def _by(rows: Sequence[dict[str, Any]], config: str) -> dict[int, dict[str, Any]]:
    return {r["concurrency"]: r for r in rows if r["config"] == config}


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: the shim's QPS against the direct ceiling, and its p99 and QPS against the legacy app."""
    shim, direct, legacy, peer = (_by(rows, c) for c in ("triton-batching", "direct", "legacy", "litserve"))
    return [{"concurrency": c, "shim_vs_direct_qps": _ratio(s, direct.get(c), "qps"),
             "shim_vs_legacy_qps": _ratio(s, legacy.get(c), "qps"),
             "shim_vs_legacy_p99": _ratio(s, legacy.get(c), "p99_ms"),
             "shim_vs_litserve_qps": _ratio(s, peer.get(c), "qps"),
             "shim_vs_litserve_p99": _ratio(s, peer.get(c), "p99_ms")} for c, s in sorted(shim.items())]


def ratios_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = _head(["clients", "QPS (3) shim / (0) direct", "QPS (3) shim / (1) legacy", "p99 (3) shim / (1) legacy",
                   "QPS (3) shim / (4) LitServe", "p99 (3) shim / (4) LitServe"], 0)
    for r in ratios(rows):
        lines.append(_row([r["concurrency"], _f(r["shim_vs_direct_qps"], 2), _f(r["shim_vs_legacy_qps"], 2),
                           _f(r["shim_vs_legacy_p99"], 2), _f(r["shim_vs_litserve_qps"], 2),
                           _f(r["shim_vs_litserve_p99"], 2)]))
    return lines


def breakdown_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = _head(["configuration", "clients", "client mean", "in shim", "decode", "preprocess", "shim queue",
                   "infer /batch", "postprocess", "shim batch", "Triton queue", "Triton compute", "Triton batch",
                   "load gen CPU", "load avg"])
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
    lines = _head(["request", "clients", "req/s against the stub", "errors", "load gen CPU ms per request"])
    for r in ceiling:
        lines.append(_row([r["request"], r["concurrency"], _f(r["qps"], 0), r["errors"],
                           _f(r["loadgen_cpu_ms_per_request"], 3)]))
    return lines


def perf_analyzer_lines(found: dict[str, Any] | None, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Triton's perf_analyzer beside the direct row: the same Triton, model and clients (bench/perf_analyzer.py)."""
    if not found or (not found["rows"] and not found.get("skipped")):
        return []
    lines = ["## Triton's own perf_analyzer beside the direct row", ""]
    if found.get("skipped"):
        lines += [f"Skipped: {found['skipped']}.", ""]
    if not found["rows"]:
        return lines
    direct = _by(rows, "direct")
    lines += ["Batch-1 binary FP32 requests of random data to the same Triton and model, closed loop, three windows "
              "as long as the direct row's warm-up and measurement together; the direct row sends the benchmark's "
              f"images as ready tensors ({found.get('tool', 'perf_analyzer')}). Commands and logs in logs/.", "",
              *_head(["clients", "perf_analyzer infer/s", "p50 ms", "p99 ms", "direct row QPS", "direct p99 ms",
                      "direct / perf_analyzer QPS"])]
    for r in found["rows"]:
        ours = direct.get(r["concurrency"], {})
        ratio = ours["qps"] / r["qps"] if ours.get("qps") and r["qps"] else None
        lines.append(_row([r["concurrency"], _f(r["qps"]), _f(r["p50_ms"]), _f(r["p99_ms"]), _f(ours.get("qps")),
                           _f(ours.get("p99_ms")), _f(ratio, 2)]))
    return [*lines, ""]


def intro(report: dict[str, Any], *packages: str) -> list[str]:
    """The command, when and on what machine: a report's first lines."""
    m = report["machine"]
    gpus = ", ".join(g["name"] for g in m["gpus"]) or "none"
    return [f"`{report['command']}`, {report['started']}, {report['elapsed_s']:.0f} s.", "",
            f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gib']} GiB, GPU: {gpus}; "
            f"Python {m['python']}, " + ", ".join(f"{p} {m['packages'].get(p)}" for p in packages)
            + (f", Triton server {m['triton_server']['version']}" if m.get("triton_server") else "")
            + f"; load average (1 min) {m['load_average'][0]} at start, {m['load_average_end'][0]} at the end; "
            f"git {m['git']}.", ""]


def markdown(report: dict[str, Any]) -> str:
    rows, s = report["results"], report["settings"]
    lines = [
        f"# Benchmark: {report['model']['arch']} ({report['model']['source']})",
        "",
        *intro(report, "torch", "tritonclient"),
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
        "Means over each window, in ms, from the shim's and Triton's metrics: `in shim` is the shim's request "
        "timer (the rest of `client mean` is HTTP and the wait for a thread), `infer /batch` one Triton round trip, "
        "`Triton queue` and `compute` per request inside Triton; batches are images per call; `load gen CPU` in % "
        "of one core; `load avg` the 1-minute load before / after, where other work shows.",
        "",
        *breakdown_table(rows),
        "",
        *perf_analyzer_lines(report.get("perf_analyzer"), rows),
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


FRONT_KINDS = ("floor", "flask", "legacy", "shim", "proxied", "direct", "profiled")
# The targets, measured side by side in one run: (name, what, comparison, bound).
TARGETS = (
    ("shim_vs_floor_qps", "shim throughput / floor throughput", ">=", 0.8),
    ("shim_vs_legacy_qps", "shim throughput / legacy front throughput", ">=", 1.5),
    ("shim_vs_floor_cpu", "shim CPU per image / floor CPU per image", "<=", 1.25),
    ("shim_vs_flask_cpu", "shim CPU per image / the Flask floor's CPU per request", "<=", 1.3),
)


def cpu_columns(window: dict[str, dict[str, float]], images: int) -> dict[str, Any]:
    """CPU per process group over the window, per good answer, and the machine's: idle, and busy beyond the groups."""
    groups = {g: w for g, w in window.items() if g != "machine"}
    out: dict[str, Any] = {"cpu": window,
                           "cpu_ms_per_image": {g: (1000 * w["cpu_s"] / images if images else None)
                                                for g, w in groups.items()}}
    spent = sum(v for v in out["cpu_ms_per_image"].values() if v)
    # What the row's own processes would serve alone on this machine's cores: to compare when others shared it
    out["cpu_bound_qps"] = len(os.sched_getaffinity(0)) * 1000 / spent if spent else None
    machine = window.get("machine")
    if machine:
        busy, idle = machine["cpu_s"], machine["idle_s"]
        other = max(0.0, busy - sum(w["cpu_s"] for w in groups.values()))
        out["machine"] = {"busy_s": busy, "idle_s": idle, "other_s": other,
                          "idle_pct": 100 * idle / (busy + idle) if busy + idle else None,
                          "other_cpu_ms_per_image": 1000 * other / images if images else None}
    return out


def front_ordered(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["concurrency"], FRONT_KINDS.index(r["kind"])))


def _ratio(row: dict[str, Any], base: dict[str, Any] | None, key: str) -> float | None:
    return row[key] / base[key] if base and base.get(key) and row.get(key) is not None else None


def front_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: every shim row against the floor (its one row) and the legacy front, the best named."""
    floor = next((r for r in rows if r["kind"] == "floor"), None)
    out = []
    for c in sorted({r["concurrency"] for r in rows if r["kind"] == "shim"}):
        legacy = next((r for r in rows if r["kind"] == "legacy" and r["concurrency"] == c), None)
        flask = next((r for r in rows if r["kind"] == "flask" and r["concurrency"] == c), None)
        flask_cpu = flask["cpu_ms_per_image"].get("flask") if flask else None
        per_transport = []
        for s in (r for r in rows if r["kind"] == "shim" and r["concurrency"] == c):
            shim_cpu = s["cpu_ms_per_image"].get("shim")
            floor_cpu = floor["cpu_ms_per_image"].get("floor") if floor else None
            per_transport.append({
                "transport": s["transport"], "reported": s.get("transport_reported"), "qps": s["qps"],
                "shim_vs_floor_qps": _ratio(s, floor, "qps"),
                "shim_vs_legacy_qps": _ratio(s, legacy, "qps"),
                "shim_vs_floor_cpu": shim_cpu / floor_cpu if shim_cpu and floor_cpu else None,
                "shim_vs_flask_cpu": shim_cpu / flask_cpu if shim_cpu and flask_cpu else None,
                "cpu_bound": {"shim_vs_floor_qps": _ratio(s, floor, "cpu_bound_qps"),
                              "shim_vs_legacy_qps": _ratio(s, legacy, "cpu_bound_qps")},
            })
        best = max(per_transport, key=lambda t: t["qps"], default=None)
        checks = []
        for key, what, op, bound in TARGETS:
            value = best[key] if best else None
            met = None if value is None else (value >= bound if op == ">=" else value <= bound)
            checks.append({"target": key, "what": what, "op": op, "bound": bound, "value": value, "met": met})
        out.append({"concurrency": c, "best_transport": best["transport"] if best else None,
                    "transports": per_transport, "checks": checks})
    return out


def check_lines(ratios_: Sequence[dict[str, Any]]) -> list[str]:
    """The targets as PASS / NOT MET lines with the measured ratios, the best transport first, then each one."""
    lines = []
    for level in ratios_:
        lines.append(f"c={level['concurrency']}, best transport {level['best_transport']} (by throughput):")
        best = next((t for t in level["transports"] if t["transport"] == level["best_transport"]), None)
        for chk in level["checks"]:
            verdict = "n/a" if chk["met"] is None else "PASS" if chk["met"] else "NOT MET"
            estimate = (best or {}).get("cpu_bound", {}).get(chk["target"])
            lines.append(f"  {verdict:<7} {chk['what']} = {_f(chk['value'], 2)} (target {chk['op']} {chk['bound']:g})"
                         + (f"; CPU-bound estimate {_f(estimate, 2)}" if estimate is not None else ""))
        for t in level["transports"]:
            lines.append(f"  transport {t['transport']} (shim reports: {t['reported']}): "
                         + ", ".join(f"{key.removeprefix('shim_vs_').replace('_', ' ')} {_f(t[key], 2)}"
                                     for key, *_ in TARGETS))
    return lines


def _ms(row: dict[str, Any], group: str) -> str:
    return _f((row.get("cpu_ms_per_image") or {}).get(group), 2)


FRONT_GROUP = {"floor": "floor", "flask": "flask", "legacy": "legacy", "shim": "shim", "proxied": "shim",
               "profiled": "shim", "direct": None}


def front_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    floor = next((r for r in rows if r["kind"] == "floor"), None)
    lines = _head(["row", "transport", "clients", "images/s", "p50 ms", "p99 ms", "front CPU ms/img",
                   "Triton CPU ms/img", "loadgen CPU ms/img", "other CPU ms/img", "idle %", "x floor",
                   "x legacy front", "CPU-bound images/s", "errors"], 2)
    for r in front_ordered(rows):
        legacy = next((x for x in rows if x["kind"] == "legacy" and x["concurrency"] == r["concurrency"]), None)
        group = FRONT_GROUP[r["kind"]]
        transport = r.get("transport") or "-"
        if r["kind"] == "shim" and r.get("transport_reported") not in (None, r.get("transport")):
            transport += f" (shim reports {r.get('transport_reported')})"
        lines.append(_row([
            r["label"], transport, r["concurrency"] if r["kind"] != "floor" else f"{r['processes']} processes",
            _f(r["qps"]), _f(r["p50_ms"]), _f(r["p99_ms"]), _ms(r, group) if group else "-", _ms(r, "triton"),
            _ms(r, "loadgen"), _f((r.get("machine") or {}).get("other_cpu_ms_per_image"), 2),
            _f((r.get("machine") or {}).get("idle_pct"), 0),
            _f(r["qps"] / floor["qps"], 2) if floor and floor["qps"] else "-",
            _f(r["qps"] / legacy["qps"], 2) if legacy and legacy["qps"] else "-", _f(r.get("cpu_bound_qps"), 0),
            r["errors"]]))
    return lines


def cpu_split(row: dict[str, Any]) -> dict[str, float] | None:
    """A shim row's front CPU per image, split by the shim's own shim_cpu_seconds counters; None without them."""
    shim = (row.get("breakdown") or {}).get("shim") or {}
    front = (row.get("cpu_ms_per_image") or {}).get("shim")
    parts = {part: shim.get(f"cpu_{part}_ms") for part in CPU_PARTS}
    if front is None or any(v is None for v in parts.values()):
        return None
    stages = parts["decode"] + parts["preprocess"]  # the request thread's; postprocess is the senders'
    return {"front": front, "decode": parts["decode"], "preprocess": parts["preprocess"],
            "postprocess": parts["postprocess"], "rest of request": parts["request"] - stages,
            "batch senders": parts["send"],
            "outside the app": front - parts["request"] - parts["send"] - parts["postprocess"]}


CPU_SPLIT = ("decode", "preprocess", "postprocess", "rest of request", "batch senders", "outside the app")


def cpu_split_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    floor = next((r for r in rows if r["kind"] == "floor"), None)
    split = [(r, cpu_split(r)) for r in front_ordered(rows) if r["kind"] == "shim"]
    if not any(s for _, s in split):
        return []
    lines = ["## Where the shim's CPU goes", "",
             "ms of CPU per image from the shim's `shim_cpu_seconds_total` counters over the same window, against "
             "its process trees' (`front`): `postprocess` the batch senders' scores and top k (once per batch), "
             "`rest of request` the request thread's other work in the app (Flask, multipart, the answer's JSON, "
             "metrics, log), `batch senders` the calls to Triton, `outside the app` gunicorn and the master."
             + (f" The floor spends {_ms(floor, 'floor')} ms per image." if floor else ""),
             "",
             *_head(["row", "clients", "front CPU ms/img", *CPU_SPLIT, "beyond decode + preprocess"])]
    for r, s in split:
        if s is None:
            continue
        lines.append(_row([r["label"], r["concurrency"], _f(s["front"], 2), *[_f(s[k], 2) for k in CPU_SPLIT],
                           _f(s["front"] - s["decode"] - s["preprocess"], 2)]))
    return [*lines, ""]


def profile_lines(profile: dict[str, Any] | None) -> list[str]:
    if not profile:
        return []
    if profile.get("error"):
        return ["## Profile of one shim worker", "", f"py-spy failed: {profile['error']}", ""]
    t, g = profile["working"]["top"], profile["gil"]
    samples = t["working_samples"] + t["waiting_samples"]
    waiting = ", ".join(f"{w['function']} {100 * w['samples'] / samples:.0f} %" for w in t["waiting_in"])
    lines = ["## Profile of one shim worker",
             "",
             f"py-spy on worker PID {profile['pid']} of the shim with transport `{profile['transport']}` "
             f"({profile['shim_workers']} workers x {profile['shim_threads']} threads, "
             f"{profile['concurrency']} clients) over "
             f"the {profile['seconds']:g} s measured window of one more run, at {profile['rate']} Hz "
             f"({_f(profile.get('qps'))} images/s while profiled: py-spy pauses the worker for each sample).",
             "",
             f"{samples} thread samples py-spy saw busy; {t['waiting_samples']} "
             f"({_f(100 * t['waiting_samples'] / samples if samples else None, 0)} %) were blocked in a call "
             f"({waiting or 'none'}) and are left out. Shares of the other {t['working_samples']}: own = the "
             "function's code and its C calls, total = anywhere on the stack.",
             ""]
    split, held = profile["working"].get("stages") or {}, g.get("stages") or {}
    if split:
        lines += ["By stage of a request (bench/profile.STAGES: the frame nearest each sample's leaf that names "
                  "one). Working samples count a thread inside a system call (a socket's send) as working; the "
                  "GIL holder's are the Python work alone:", "", *_head(["stage", "working samples %", "GIL holder %"])]
        lines += [_row([name, _f(share), _f(held.get(name))]) for name, share in split.items()]
        lines.append("")
    for key, title in (("by_own", "by own time"), ("by_total", "by total time")):
        lines += [f"Top {len(t[key])} {title}:", "", *_head(["function", "own %", "total %"])]
        lines += [_row([e["function"], _f(e["own_pct"]), _f(e["total_pct"])]) for e in t[key]]
        lines.append("")
    lines += [f"The GIL holder (`py-spy --gil`, at the same time): the GIL was held "
              f"{_f(g['held_pct'], 0)} % of the window ({g['samples']} samples); what held it, by own time:", "",
              *_head(["function", "own %", "total %"])]
    lines += [_row([e["function"], _f(e["own_pct"]), _f(e["total_pct"])]) for e in g["top"]["by_own"]]
    lines.append("")
    return lines


def front_markdown(report: dict[str, Any]) -> str:
    rows, s = report["results"], report["settings"]
    lines = [
        "# Front-end benchmark: the shim's CPU per image against the decode + preprocess floor",
        "",
        *intro(report, "tritonclient"),
        f"Closed loop, {s['warmup_s']:g} s warm-up (discarded) then {s['duration_s']:g} s measured per row; "
        f"each client uploads one of {s['images']} different {s['image_size']} JPEGs. The model is "
        f"{report['model']['description']}. CPU columns: ms of CPU per good answer over the window, of whole "
        "process trees (/proc): `front` the server under test (or the floor's processes), `Triton` with its "
        "stubs, `loadgen`, and `other`, the machine's busy CPU none of those explains (a row with more than a "
        "few tenths of a ms shared the machine: compare it with care). `CPU-bound images/s` = cores x 1000 / "
        "(front + Triton + loadgen ms per image): an estimate of the row alone on the machine, not a measurement.",
        "",
        "## Rows",
        "",
        *front_table(rows),
        "",
        *[f"- {c['label']}: {c['description']}" for c in report["configurations"]],
        "",
        *cpu_split_lines(rows),
        *report.get("crosscheck_lines", []),  # bench/frontcheck.py: wrk, CPU per image, GPU-host estimates
        "## Targets",
        "",
        "```",
        *check_lines(report["ratios"]),
        "```",
        "",
        *profile_lines(report.get("profile")),
    ]
    if report.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)
