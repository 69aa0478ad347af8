"""app/malloc.py: glibc's mmap threshold fixed, in a process of its own (it changes the process's malloc)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_buffer_freed_goes_back_to_the_system_once_the_threshold_is_fixed() -> None:
    """With glibc's dynamic threshold, 16 MiB buffers allocated after a larger one was freed come from the heap,
    and freed between live small objects they stay with malloc (the process's resident memory stays up); with
    the threshold fixed at 4 MiB each is a mapping of its own, unmapped at free()."""
    script = """
import sys
from app.malloc import give_back_large_buffers
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
if sys.argv[1] == "fixed":
    assert give_back_large_buffers()
first = bytearray(20 << 20); del first        # freed: glibc raises its threshold to 20 MiB (unless fixed)
held, small = [], []
for _ in range(8):                             # 128 MiB, each touched, with live small objects between
    held.append(bytearray(16 << 20))
    small.append(bytearray(64 << 10))
before = rss_kib()
del held
print(before - rss_kib())                      # what free() gave back, in KiB
"""
    given_back = {}
    for mode in ("default", "fixed"):
        result = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60,
                                check=True)
        given_back[mode] = int(result.stdout.strip())
    assert given_back["fixed"] >= 120 * 1024, given_back  # the 128 MiB are unmapped
    assert given_back["default"] < given_back["fixed"], given_back
