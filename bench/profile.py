"""py-spy on one shim worker over a measured window: the functions that take its time, by own and total share.

py-spy sees a thread blocked in a C call (a queue's get, select) as busy: a sample whose leaf line is a blocking
call (BLOCKING) counts as waiting, left out of the shares. A second py-spy (`--gil`) samples the GIL holder
alone: its share of the window says whether the worker is bound by its GIL.
"""

from __future__ import annotations

import linecache
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RATE = 100  # samples per second (py-spy's default)
# A leaf line making one of these calls is a thread waiting (`with self._lock:`: a lock being acquired).
BLOCKING = re.compile(r"\.(get|wait|wait_for|acquire|select|poll|recv|recv_into|recvfrom|accept|join|sleep)\("
                      r"|\b(sleep|select|wait)\(|\bloop\.run\(|^\s*with\s+[\w.]+:\s*$")
# Frames every thread has: 100 % of the samples by construction, left out of the ranking by total time.
BOOTSTRAP = {"Thread._bootstrap (threading.py)", "Thread._bootstrap_inner (threading.py)",
             "Thread.run (threading.py)"}
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def start(pid: int, seconds: float, raw: Path, gil: bool = False) -> subprocess.Popen[bytes]:
    """Start recording `pid` for `seconds` into `raw` (py-spy's raw format); finish() waits for it. gil: only the
    thread holding the GIL, read without pausing the worker (a second recorder beside the pausing one)."""
    local = Path(sys.executable).with_name("py-spy")  # the virtualenv's, else one on PATH
    binary = str(local) if local.is_file() else shutil.which("py-spy")
    if binary is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy (it is in the dev extra)")
    cmd = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(RATE),
           "--full-filenames", "--format", "raw", "--output", str(raw)]
    if gil:
        cmd += ["--gil", "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def parse_raw(text: str) -> tuple[Counter[tuple[str, ...]], int]:
    """py-spy's raw lines -> ({stack (root first): samples}, total samples)."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks, sum(stacks.values())


def short_file(file: str) -> str:
    """A path as its package sees it: '.../site-packages/PIL/Image.py' -> 'PIL/Image.py'."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in file:
            return file.rsplit(marker, 1)[1]
    if match := re.search(r"/lib/python3\.\d+/(.*)$", file):
        return match.group(1)
    for top in ("/app/", "/bench/", "/modelrepo/", "/devstack/", "/report/", "/examples/"):
        if top in file:
            return top.strip("/") + "/" + file.rsplit(top, 1)[1]
    return file


def function_of(frame: str) -> str:
    """'decode (/x/app/preprocess.py:62)' -> 'decode (app/preprocess.py)': one entry per function."""
    match = FRAME.match(frame)
    if not match:
        return frame
    return f"{match['function']} ({short_file(match['file'])})"


def is_waiting(leaf: str) -> bool:
    """Whether the leaf frame's source line is a blocking call (read from the file py-spy named)."""
    match = FRAME.match(leaf)
    if not match or not match["line"]:
        return False
    return bool(BLOCKING.search(linecache.getline(match["file"], int(match["line"]))))


def top(stacks: Counter[tuple[str, ...]], limit: int = 15, skip_waiting: bool = True) -> dict[str, Any]:
    """The `limit` functions with the most own samples and with the most total samples, of the working samples
    (all samples with skip_waiting=False: the GIL holder is never blocked)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    for stack, count in stacks.items():
        if skip_waiting and is_waiting(stack[-1]):
            waiting[function_of(stack[-1])] += count
            continue
        frames = [function_of(f) for f in stack]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    working = sum(own.values())

    def entry(f: str) -> dict[str, Any]:
        return {"function": f, "own_pct": 100 * own[f] / working, "total_pct": 100 * inclusive[f] / working}

    def ranked(counts: Counter[str]) -> list[str]:  # most first; ties by name, so the order is stable
        return [f for f, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if f not in BOOTSTRAP]

    return {
        "working_samples": working,
        "waiting_samples": sum(waiting.values()),
        "waiting_in": [{"function": f, "samples": n} for f, n in waiting.most_common(5)],
        "by_own": [entry(f) for f in ranked(own)[:limit]] if working else [],
        "by_total": [entry(f) for f in ranked(inclusive)[:limit]] if working else [],
    }


# The stages of a /predict by the files of their code: a sample counts for the frame nearest its leaf that matches.
STAGES = (
    # app/backends/triton/ too: its Wire moves the bytes of every infer call (tritonclient only builds and parses).
    ("Triton request: build, send, parse",
     re.compile(r"^(tritonclient|geventhttpclient|gevent|grpc|app/backends/triton)/")),
    ("batcher hand-off", re.compile(r"^app/batching\.py")),
    ("multipart cut", re.compile(r"^app/uploads\.py")),
    ("sniff", re.compile(r"^app/sniff\.py")),
    ("JSON answer", re.compile(r"^(json/|flask/json/|app/contract\.py)")),
    ("scores, top-k", re.compile(r"^app/(scores|service)\.py")),
    ("metrics, log line", re.compile(r"^(prometheus_client/|logging/|app/(metrics|logs|gunicorn_logger)\.py)")),
    ("gunicorn: HTTP parse, body read, socket", re.compile(r"^gunicorn/")),
    ("Flask, Werkzeug", re.compile(r"^(flask|werkzeug)/")),
    ("other shim code", re.compile(r"^app/")),
)


def stages(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Share (%) of the working samples per stage of STAGES ("other": Python's own, threading, selectors)."""
    counts: Counter[str] = Counter()
    for stack, count in stacks.items():
        if is_waiting(stack[-1]):
            continue
        files = (short_file(m["file"]) if (m := FRAME.match(frame)) else frame for frame in reversed(stack))
        counts[next((stage for file in files for stage, pattern in STAGES if pattern.search(file)), "other")] += count
    working = sum(counts.values())
    return {name: 100 * counts[name] / working for name in [*(s for s, _ in STAGES), "other"]} if working else {}


def finish(process: subprocess.Popen[bytes], raw: Path, seconds: float, gil: bool = False,
           limit: int = 15) -> dict[str, Any]:
    """Wait for one py-spy and summarise what it wrote."""
    output, _ = process.communicate(timeout=seconds + 60)
    log = output.decode(errors="replace").strip()
    if process.returncode != 0 or not raw.is_file():
        return {"error": f"py-spy exited {process.returncode}: {log[-2000:]}"}
    stacks, samples = parse_raw(raw.read_text())
    out = {"samples": samples, "stacks": len(stacks), "raw": str(raw), "top": top(stacks, limit, not gil),
           "stages": stages(stacks)}
    if gil:
        out["held_pct"] = 100 * samples / (RATE * seconds)
    return out
