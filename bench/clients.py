"""`python -m bench --clients`: tritonclient's HTTP and gRPC clients, the CPU each costs per image, per route.

On the near-free stand-in, per route (fp32, uint8, encoded: the shim's transports) and batch size, each client
in turns: a process of --threads clients in a closed loop; its CPU (rusage) and Triton's (/proc) per image.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import threading
import time
from typing import Any

from bench import cpu, stack
from report.percentiles import median

MODEL = "resnet50"
ROUTES = {"fp32": (MODEL, "input__0"), "uint8": (f"{MODEL}_uint8", "input__0"),
          "encoded": (f"{MODEL}_encoded", "encoded")}


def batch_of(route: str, batch: int, jpeg: bytes) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    if route == "fp32":
        return rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)
    if route == "uint8":
        return rng.integers(0, 256, (batch, 224, 224, 3), dtype=np.uint8)
    return np.array([[jpeg]] * batch, dtype=object)  # the encoded route: one upload per row (BYTES [N, 1])


def client_loop(kind: str, url: str, route: str, batch: int, jpeg: bytes, threads: int, duration_s: float,
                results: Any) -> None:
    """In a process of its own: `threads` clients in a closed loop; puts (images, cpu_s, errors)."""
    if kind == "grpc":
        import tritonclient.grpc as client
    else:
        import tritonclient.http as client  # type: ignore[no-redef]
    model, input_name = ROUTES[route]
    data = batch_of(route, batch, jpeg)
    counts = [0] * threads
    errors = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def run(i: int) -> None:
        triton = client.InferenceServerClient(url)
        dtype = {"f": "FP32", "u": "UINT8", "O": "BYTES"}[data.dtype.kind]
        inp = client.InferInput(input_name, list(data.shape), dtype)
        out = client.InferRequestedOutput("output__0", **({} if kind == "grpc" else {"binary_data": True}))
        for _ in range(3):  # warm: connection, first request
            inp.set_data_from_numpy(data, **({} if kind == "grpc" else {"binary_data": True}))
            triton.infer(model, [inp], outputs=[out])
        start.wait()
        while not stop.is_set():
            try:
                inp.set_data_from_numpy(data, **({} if kind == "grpc" else {"binary_data": True}))
                triton.infer(model, [inp], outputs=[out]).as_numpy("output__0")
                counts[i] += batch
            except Exception:  # counted: a client that fails is no cheaper
                errors[i] += 1
        triton.close()

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(duration_s)
    after = resource.getrusage(resource.RUSAGE_SELF)
    images = sum(counts)
    stop.set()
    for w in workers:
        w.join(timeout=30)
    results.put((images, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), sum(errors)))


def measure(kind: str, triton: Any, tpid: int, route: str, batch: int, jpeg: bytes,
            args: argparse.Namespace) -> dict[str, Any]:
    url = f"{triton.config.host}:{triton.config.grpc_port}" if kind == "grpc" else triton.http_url
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=client_loop, args=(kind, url, route, batch, jpeg, args.threads,
                                                        args.duration, results))
    cpu.wait_idle((tpid,), timeout_s=20)
    process.start()
    # Triton's window: from when the clients are warm to the end (the first put comes after the window)
    time.sleep(0.5)
    first = cpu.snapshot({"triton": (tpid,)})
    images, client_s, errors = results.get(timeout=args.duration + 120)
    last = cpu.snapshot({"triton": (tpid,)})
    process.join(timeout=30)
    triton_s = cpu.window_seconds(first, last)["triton"]["cpu_s"]
    return {"client": kind, "route": route, "batch": batch, "images_per_s": images / args.duration,
            "client_cpu_ms_per_image": 1000 * client_s / images if images else None,
            "triton_cpu_ms_per_image": 1000 * triton_s / images if images else None, "errors": errors}


def main(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with stack.standin_triton("bench-clients-", "encoded" in args.routes) as (_, _, triton):
        jpeg = stack.sample_jpegs(1, 640, 480)[0]
        tpid = stack.triton_pid(triton)
        for route in args.routes:
            for batch in args.batches if route != "encoded" else [1]:
                for round_ in range(args.rounds):
                    for kind in ("http", "grpc"):
                        row = measure(kind, triton, tpid, route, batch, jpeg, args)
                        row["round"] = round_ + 1
                        rows.append(row)
                        print(f"  {route} batch {batch} {kind} (round {round_ + 1}): {row['images_per_s']:.0f} "
                              f"images/s, client {row['client_cpu_ms_per_image'] or 0:.3f} ms CPU per image, "
                              f"Triton {row['triton_cpu_ms_per_image'] or 0:.3f}; {row['errors']} errors", flush=True)
    summary = {}
    for route in args.routes:
        for batch in sorted({r["batch"] for r in rows if r["route"] == route}):
            cell = {}
            for kind in ("http", "grpc"):
                mine = [r for r in rows if (r["route"], r["batch"], r["client"]) == (route, batch, kind)]
                cell[kind] = {k: median(r[k] or 0 for r in mine)
                              for k in ("client_cpu_ms_per_image", "triton_cpu_ms_per_image")}
            summary[f"{route} x{batch}"] = cell
    print(json.dumps({"threads": args.threads, "duration_s": args.duration, "median": summary}, indent=1))
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --clients", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--routes", type=lambda s: s.split(","), default=list(ROUTES), help="fp32,uint8,encoded")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                   help="batch sizes of the tensor routes (default 1,8; encoded: 1)")
    p.add_argument("--threads", type=int, default=4, help="clients at once (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="turns of both clients (default 2)")
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per row (default 6)")
    return p.parse_args(argv)
