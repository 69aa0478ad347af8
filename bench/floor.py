"""The floor of the shim's request path: `app.preprocess.decode` + `to_tensor` alone in N spawned processes on
the benchmark's JPEGs, no HTTP, for the same warm-up and window as the other rows (one Outcome, as a row).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Sequence

from bench import cpu
from bench.loadgen import Outcome


def _work(conn: multiprocessing.connection.Connection, jpegs: Sequence[bytes], offset: int, warmup_s: float,
          duration_s: float) -> None:
    try:
        from app.preprocess import ImageSpec, configure_pillow, decode, to_tensor

        spec = ImageSpec()
        configure_pillow(spec)
        to_tensor(decode(jpegs[0], spec), spec)  # imports and first-call costs, before the clock
        conn.send("ready")
        start_at = conn.recv()
        out = Outcome(window_s=duration_s)
        window_start = start_at + warmup_s
        window_end = window_start + duration_s
        time.sleep(max(0.0, start_at - time.monotonic()))
        k = offset
        while (started := time.monotonic()) < window_end:
            to_tensor(decode(jpegs[k % len(jpegs)], spec), spec)
            k += 1
            out.record(started, time.monotonic(), window_start)
        conn.send(out)
    except Exception:
        conn.send(traceback.format_exc())


def run_floor(jpegs: Sequence[bytes], processes: int, warmup_s: float, duration_s: float,
              extra_watch: dict[str, tuple[int, ...]] | None = None) -> tuple[Outcome, dict[str, dict[str, float]]]:
    """Decode + preprocess in `processes` processes: the merged Outcome and the CPU of each group over the window."""
    ctx = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for index in range(processes):
        parent, child = ctx.Pipe()
        worker = ctx.Process(target=_work, name=f"bench-floor-{index}", daemon=True,
                             args=(child, list(jpegs), index * 7, warmup_s, duration_s))
        worker.start()
        child.close()
        pipes.append(parent)
        workers.append(worker)
    try:
        groups = {"floor": tuple(w.pid for w in workers if w.pid is not None), **(extra_watch or {})}
        for conn, worker in zip(pipes, workers, strict=True):  # every interpreter up, numpy and Pillow imported
            answer = conn.recv() if conn.poll(120) else None
            if answer != "ready":
                raise RuntimeError(f"{worker.name} did not start: {answer}")
        start_at = time.monotonic() + 0.05
        for conn in pipes:
            conn.send(start_at)
        window_start = start_at + warmup_s
        time.sleep(max(0.0, window_start - time.monotonic()))
        first = cpu.snapshot(groups)
        time.sleep(max(0.0, window_start + duration_s - time.monotonic()))
        last = cpu.snapshot(groups)
        merged = Outcome(window_s=duration_s)
        for conn, worker in zip(pipes, workers, strict=True):
            if not conn.poll(60):
                raise RuntimeError(f"{worker.name} did not answer (exit code {worker.exitcode})")
            answer = conn.recv()
            if isinstance(answer, str):
                raise RuntimeError(f"{worker.name} failed:\n{answer}")
            merged.add(answer)
        return merged, cpu.window_seconds(first, last)
    finally:
        for conn, worker in zip(pipes, workers, strict=True):
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()
            conn.close()
