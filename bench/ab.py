"""`python -m bench --ab`: the shim's CPU per image under two or more environments, rows alternated in one run.

A process setting (malloc tuning, a transport) moves a few percent of CPU: only rows measured in turns, on the
near-free stand-in and by wrk, compare. A variant is NAME=ENV, ENV space-separated VAR=VALUE pairs (none: the
shim as it ships), e.g. `--variant 'fixed=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304' --variant 'default='`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import cpu, frontend, stack, wrk
from report.percentiles import median


def variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, env = text.partition("=")
    pairs = [pair.partition("=") for pair in env.split()]
    if not name or any(not sep for _, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VAR=VALUE [VAR=VALUE ...] or NAME=")
    return name, {k: v for k, _, v in pairs}


def main(args: argparse.Namespace) -> int:
    binary = wrk.find_or_install()
    if binary is None:
        raise SystemExit("bench --ab needs wrk (apt-get install wrk)")
    stopper = stack.Stopper()
    rows: list[dict[str, Any]] = []
    with stack.standin_triton("bench-ab-", args.transport == "encoded") as (work, _, triton):
        try:
            script = wrk.lua_script(work / "wrk", stack.sample_jpegs(16, 640, 480))
            tpid = stack.triton_pid(triton)
            for round_ in range(args.rounds):
                for name, env in args.variant:
                    shim_env = {**frontend.shim_env(triton.http_url, args.transport, args.workers, args.threads),
                                **env}
                    with stack.serve_shim(work, shim_env, stopper, args.workers) as served:
                        measure(binary, script, served.url, args.connections, 3, {"shim": (served.process.pid,)})
                        row = measure(binary, script, served.url, args.connections, args.duration,
                                      {"shim": (served.process.pid,), "triton": (tpid,)})
                    row.update(variant=name, round=round_ + 1)
                    rows.append(row)
                    print(f"  {name} (round {round_ + 1}): {row['qps']:.1f} images/s, shim "
                          f"{row['cpu_ms_per_image']['shim']:.2f} ms CPU per image, Triton "
                          f"{row['cpu_ms_per_image']['triton']:.2f}; p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms; "
                          f"{row['non_2xx']} non-2xx", flush=True)
                    stopper.settle()
        finally:
            stopper.settle()
    summary = {name: median(r["cpu_ms_per_image"]["shim"] for r in rows if r["variant"] == name)
               for name, _ in args.variant}
    print(json.dumps({"transport": args.transport, "connections": args.connections, "duration_s": args.duration,
                      "median_shim_cpu_ms_per_image": summary, "rows": [
                          {k: r[k] for k in ("variant", "round", "qps", "p50_ms", "p99_ms", "non_2xx",
                                             "cpu_ms_per_image")} for r in rows]}, indent=1))
    return 0


def measure(binary: str, script: Path, url: str, connections: int, duration_s: float,
            watch: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    cpu.wait_idle([pid for pids in watch.values() for pid in pids], timeout_s=20)
    return wrk.measure(binary, script, url, connections, duration_s, watch)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", type=variant, action="append", required=True, help="NAME=VAR=VALUE ... (repeat)")
    p.add_argument("--transport", default="uint8", help="SHIM_TRANSPORT of every shim (default uint8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all variants (default 2)")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per row (default 15)")
    p.add_argument("--connections", type=int, default=16, help="wrk connections (default 16)")
    p.add_argument("--workers", type=int, default=2, help="the shim's workers (default 2)")
    p.add_argument("--threads", type=int, default=72, help="the shim's threads per worker (default 72, as it ships)")
    return p.parse_args(argv)
