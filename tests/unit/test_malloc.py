"""app/malloc.py: malloc_trim gives back what glibc's arenas keep, in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_gives_back_large_buffers_that_free_kept() -> None:
    """With glibc's dynamic threshold, 16 MiB buffers allocated after a larger one was freed come from the heap,
    and freed between live small objects they stay with malloc (the process's resident memory stays up);
    trim() returns their pages."""
    script = """
import sys
from app.malloc import trim
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
first = bytearray(20 << 20); del first        # freed: glibc raises its threshold to 20 MiB
held, small = [], []
for _ in range(8):                             # 128 MiB, each touched, with live small objects between
    held.append(bytearray(16 << 20))
    small.append(bytearray(64 << 10))
before = rss_kib()
del held
freed = before - rss_kib()
if sys.argv[1] == "trim":
    assert trim()
print(before - rss_kib(), freed)               # what was given back, in KiB
"""
    given_back = {}
    for mode in ("free", "trim"):
        result = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60,
                                check=True)
        given_back[mode] = [int(x) for x in result.stdout.split()]
    assert given_back["free"][0] < 64 * 1024, given_back  # free() alone kept most of the 128 MiB
    assert given_back["trim"][0] >= 120 * 1024, given_back  # trim() returned them


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_few_arenas_is_accepted_by_glibc() -> None:
    """mallopt(M_ARENA_MAX) answers 1 when glibc took it (0 for an option it does not know)."""
    result = subprocess.run([sys.executable, "-c", "from app.malloc import few_arenas; assert few_arenas()"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
