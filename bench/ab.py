"""`python -m bench --ab`: the shim's CPU per image under two or more variants, rows alternated in one run.

A process setting (malloc tuning, a transport) or a code change moves a few percent of CPU: only rows measured in
turns, on the near-free stand-in and by wrk, compare. A variant is NAME=ENV, ENV space-separated VAR=VALUE pairs
(none: the shim as it ships) and, optionally, @PATH: a checkout of the shim (`git worktree add`) whose app/ runs,
with this one's virtualenv, e.g. `--variant 'fixed=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304' --variant
'default='` or `--variant 'before=@/tmp/before' --variant 'after='`. Each round starts with the Flask floor
(bench/flask_floor.py); every row adds the context switches per image of its process tree and the shim's mean
batch (its /metrics): where CPU goes to threads handing work to each other, they show it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import cpu, frontend, stack, wrk
from report.percentiles import median

FLOOR = "Flask floor"


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    root: Path = stack.ROOT  # the checkout whose app/ the shim runs


def variant(text: str) -> Variant:
    name, _, spec = text.partition("=")
    words = spec.split()
    roots = [Path(w[1:]).resolve() for w in words if w.startswith("@")]
    pairs = [w.partition("=") for w in words if not w.startswith("@")]
    if not name or name == FLOOR or len(roots) > 1 or any(not sep for _, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VAR=VALUE [VAR=VALUE ...] [@CHECKOUT] or NAME=")
    if roots and not (roots[0] / "app" / "gunicorn_conf.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {roots[0]} is not a checkout of the shim (no app/)")
    return Variant(name, {k: v for k, _, v in pairs}, *roots)


def main(args: argparse.Namespace) -> int:
    binary = wrk.find_or_install()
    if binary is None:
        raise SystemExit("bench --ab needs wrk (apt-get install wrk)")
    stopper = stack.Stopper()
    rows: list[dict[str, Any]] = []
    with stack.standin_triton("bench-ab-", args.transport == "encoded") as (work, _, triton):
        try:
            script = wrk.lua_script(work / "wrk", stack.sample_jpegs(16, 640, 480))
            (work / "logs").mkdir(exist_ok=True)
            tpid = stack.triton_pid(triton)
            for round_ in range(args.rounds):
                with frontend.flask_floor(work, stopper) as served:
                    rows.append(row_of(FLOOR, round_, binary, script, served, args.connections, args.duration, {}))
                stopper.settle()
                for v in args.variant:
                    shim_env = {**frontend.shim_env(triton.http_url, args.transport, args.workers, args.threads),
                                **v.env}
                    with stack.serve_shim(work, shim_env, stopper, args.workers, root=v.root) as served:
                        rows.append(row_of(v.name, round_, binary, script, served, args.connections, args.duration,
                                           {"triton": (tpid,)}))
                    stopper.settle()
        finally:
            stopper.settle()
    floor = median(r["cpu_ms_per_image"]["shim"] for r in rows if r["variant"] == FLOOR)
    summary = {v.name: median(r["cpu_ms_per_image"]["shim"] for r in rows if r["variant"] == v.name)
               for v in args.variant}
    print(json.dumps({"transport": args.transport, "connections": args.connections, "duration_s": args.duration,
                      "median_flask_floor_cpu_ms_per_request": floor, "median_shim_cpu_ms_per_image": summary,
                      "median_shim_over_flask_floor": {k: round(v / floor, 3) for k, v in summary.items()},
                      "rows": [{k: r[k] for k in ("variant", "round", "qps", "p50_ms", "p99_ms", "non_2xx",
                                                  "cpu_ms_per_image", "switches_per_image", "mean_batch")}
                               for r in rows]}, indent=1))
    return 0


def row_of(name: str, round_: int, binary: str, script: Path, served: Any, connections: int, duration_s: float,
           also: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """One warmed-up wrk window against `served` (its tree counted as "shim"), with switches and mean batch."""
    url, pid = served.url + "/predict", served.process.pid
    measure(binary, script, url, connections, 3, {"shim": (pid,)})
    before, batches = context_switches(pid), batch_totals(served.url)
    row = measure(binary, script, url, connections, duration_s, {"shim": (pid,), **also})
    good = row["requests"] - row["non_2xx"]
    after_batches = batch_totals(served.url)
    calls = after_batches[1] - batches[1]
    row.update(variant=name, round=round_ + 1, switches_per_image=round((context_switches(pid) - before) / good, 1)
               if good else None, mean_batch=round((after_batches[0] - batches[0]) / calls, 2) if calls else None)
    cpu_ms = row["cpu_ms_per_image"]
    triton = f", Triton {cpu_ms['triton']:.2f}" if "triton" in cpu_ms else ""
    print(f"  {name} (round {round_ + 1}): {row['qps']:.1f} images/s, {cpu_ms['shim']:.2f} ms CPU per image{triton}; "
          f"{row['switches_per_image']} context switches per image, mean batch {row['mean_batch']}; "
          f"p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms; {row['non_2xx']} non-2xx", flush=True)
    return row


def context_switches(root: int) -> int:
    """Voluntary and involuntary context switches of every thread of `root` and its children, so far."""
    total = 0
    for pid in (root, *cpu.children_of(root)):
        with contextlib.suppress(psutil.NoSuchProcess):
            for thread in psutil.Process(pid).threads():
                with contextlib.suppress(OSError):
                    status = Path(f"/proc/{pid}/task/{thread.id}/status").read_text()
                    total += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
    return total


def batch_totals(url: str) -> tuple[float, float]:
    """(images, calls) of the shim's triton batcher so far (shim_batch_size); (0, 0) where there is none."""
    samples = stack.scrape(url + "/metrics", timeout_s=10) or {}
    return (stack.total(samples, "shim_batch_size_sum", backend="triton"),
            stack.total(samples, "shim_batch_size_count", backend="triton"))


def measure(binary: str, script: Path, url: str, connections: int, duration_s: float,
            watch: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    cpu.wait_idle([pid for pids in watch.values() for pid in pids], timeout_s=20)
    return wrk.measure(binary, script, url, connections, duration_s, watch)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help="NAME=VAR=VALUE ... [@CHECKOUT] (repeat)")
    p.add_argument("--transport", default="uint8", help="SHIM_TRANSPORT of every shim (default uint8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all variants (default 2)")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per row (default 15)")
    p.add_argument("--connections", type=int, default=16, help="wrk connections (default 16)")
    p.add_argument("--workers", type=int, default=2, help="the shim's workers (default 2)")
    p.add_argument("--threads", type=int, default=72, help="the shim's threads per worker (default 72, as it ships)")
    return p.parse_args(argv)
