"""How the CPU copy runs a libtorch model on this machine's cores: the config's instances sharing the cores
(2 instances x 1 thread on 2 cores), or one instance with every core, whichever this CPU runs faster.

It depends on the CPU, not on the model alone. On the AMD EPYC of 2026-12-05 a ResNet-50 forward took 73 ms per
image on one thread and 30 on two (torch skips oneDNN for 1x1 convolutions on one thread), so one wide instance
served 1.2x the images of two narrow ones; on the older Xeon of 2026-12-03 two instances won. So it is measured:
once per model file and machine, in a subprocess (torch is never imported here), a few seconds, remembered in
~/.cache/flask-triton-shim/cpu_layouts.json when the machine was quiet (under `make test` two threads timed 3x
slower than one). A model the measurement cannot run keeps the config's layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("embedded_triton")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flask-triton-shim" / "cpu_layouts.json"
BATCH = 4  # images per timed forward: what 16 clients' batches hold on a CPU
TIMEOUT_S = 300
MARGIN = 1.1  # how much more one wide instance must serve than the config's narrow ones
QUIET_LOAD = 0.5  # load average per core under which a timing is remembered on disk
_TIMED: dict[str, dict[str, float]] = {}  # this process's timings, by _key (tests time each model once)


@dataclass(frozen=True)
class Layout:
    instances: int
    threads: int
    images_per_s: float | None = None  # measured (None: not measured, the config's layout kept)

    def __str__(self) -> str:
        rate = "" if self.images_per_s is None else f", {self.images_per_s:.1f} images/s measured"
        return f"{self.instances} instance{'s' * (self.instances > 1)} x {self.threads} thread" \
               f"{'s' * (self.threads > 1)}{rate}"


def shared(cpus: int, instances: int) -> Layout:
    """The config's instances sharing the cores: the layout unless one wide instance clearly wins."""
    return Layout(instances, max(1, cpus // instances))


def choose(cpus: int, instances: int, seconds_per_image: dict[int, float]) -> tuple[Layout, Layout]:
    """(the layout to run, the one it beat) from one instance's seconds per image at each thread count.
    `instances` narrow instances are counted as if they never slowed each other (they do: memory bandwidth),
    and the wide one must serve MARGIN more: the config's layout stays unless the other clearly wins (a timing
    on a busy machine favours it too: threads that wait for a busy core slow the wide instance most)."""
    narrow_threads = shared(cpus, instances).threads
    narrow_rate, wide_rate = instances / seconds_per_image[narrow_threads], 1 / seconds_per_image[cpus]
    narrow, wide = Layout(instances, narrow_threads, narrow_rate), Layout(1, cpus, wide_rate)
    return (wide, narrow) if wide_rate > MARGIN * narrow_rate else (narrow, wide)


@functools.lru_cache(maxsize=256)
def decide(model_dir: Path, filename: str, dims: tuple[int, ...], cpus: int, instances: int) -> tuple[Layout, str]:
    """The layout of the model in `model_dir` (its newest version's `filename` timed) for `instances` (the
    config's count) on `cpus` cores, and a line that says why. Decided once per model in a process: a new
    version served beside the others (a hot reload) keeps the layout, and the copy, synced every few seconds,
    is not timed again."""
    config = shared(cpus, instances)
    versions = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    if cpus < 2 or instances < 2 or not versions:
        return config, "the config's layout (nothing else to try)"
    model_file = model_dir / str(max(versions)) / filename
    try:
        key = _key(model_file, list(dims), cpus)
    except OSError as e:
        return config, f"the config's layout ({model_file} unreadable: {e})"
    timings = _TIMED.get(key) or _read_cache().get(key)
    if timings is None:
        quiet = os.getloadavg()[0] <= QUIET_LOAD * cpus
        measured = _measure(model_file, list(dims), sorted({config.threads, cpus}))
        if isinstance(measured, str):  # not remembered on disk: a fixed model is timed in the next process
            log.warning("the CPU copy of %s keeps the config's layout: timing %s failed: %s", model_dir.name,
                        model_file, measured)
            return config, f"the config's layout (the timing failed: {measured})"
        timings = _TIMED[key] = measured
        if quiet:  # a busy machine's figure serves this process only: the next start times it again
            _write_cache({**_read_cache(), key: timings})
    chosen, other = choose(cpus, instances, {int(k): float(v) for k, v in timings.items()})
    why = f"{chosen}, faster here than {other} (devstack/cpu_layout.py)"
    log.info("the CPU copy of %s runs %s", model_dir.name, why)
    return chosen, why


def _key(model_file: Path, dims: list[int], cpus: int) -> str:
    digest = hashlib.sha256()  # the weights' content: the same model in another folder is not timed again
    with model_file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return f"{digest.hexdigest()[:24]} {dims} cpus={cpus} {_cpu_name()} {sys.executable}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache() -> dict[str, dict[str, float]]:
    try:
        data = json.loads(CACHE.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, dict[str, float]]) -> None:
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(CACHE)
    except OSError as e:  # a read-only home: measured again next time, nothing worse
        log.warning("cannot remember the CPU layout in %s: %s", CACHE, e)


def _measure(model_file: Path, dims: list[int], threads: list[int]) -> dict[str, float] | str:
    """Seconds per image at each thread count, or why they could not be measured."""
    log.info("timing %s on %s threads to pick the CPU copy's instance layout (remembered per weights and "
             "machine when it is quiet) ...", model_file, " and ".join(map(str, threads)))
    try:
        done = subprocess.run([sys.executable, "-m", "devstack.cpu_layout", str(model_file), json.dumps(dims),
                               json.dumps(threads)], capture_output=True, text=True, timeout=TIMEOUT_S,
                              cwd=Path(__file__).resolve().parent.parent)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit {done.returncode}: {last[:200]}"
    timings: dict[str, float] = json.loads(lines[-1])
    return timings


def _time_forwards(model_file: str, dims: list[int], threads: list[int]) -> dict[str, float]:
    """Seconds per image of one forward of BATCH images at each thread count: the best of rounds taken in
    turns, so that a moment of other work on the machine does not land on one count only."""
    import time

    import torch

    torch.set_num_interop_threads(1)
    model = torch.jit.load(model_file, map_location="cpu").eval()  # type: ignore[no-untyped-call]
    batch = torch.rand(BATCH, *dims)
    best = {n: float("inf") for n in threads}
    with torch.inference_mode():
        for n in threads:  # TorchScript optimises in its first calls
            torch.set_num_threads(n)
            model(batch)
            model(batch)
        spent = 0.0
        for round_ in range(20):
            for n in threads:
                torch.set_num_threads(n)
                start = time.perf_counter()
                model(batch)
                took = time.perf_counter() - start
                best[n], spent = min(best[n], took), spent + took
            if round_ >= 2 and spent > 2.0:
                break
    return {str(n): t / BATCH for n, t in best.items()}


if __name__ == "__main__":
    print(json.dumps(_time_forwards(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
