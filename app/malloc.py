"""glibc's malloc told to give large buffers back to the system when they are freed.

An upload (up to SHIM_MAX_UPLOAD_MB) and a decoded image (Pillow allocates it in blocks of 16 MiB) are large
buffers that live for one request, in many threads. glibc serves a buffer over its mmap threshold from a
mapping of its own, unmapped at free(); but the threshold rises, up to 32 MiB, every time such a buffer is
freed, so after the first requests those buffers come from the per-thread arenas instead, and an arena keeps
what was freed in it. Measured (`python -m bench --memory`: 64 uploads of 16 MiB at once, each a 40 M pixel
image, one worker), the worker's peak was 4.5 GiB with glibc's default and 2.1 GiB with the threshold fixed
at 4 MiB, which also turns the rise off. app/gunicorn_conf.py sets it in the master, before the workers fork
(they inherit it). Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD_BYTES = 4 << 20  # over this, a buffer is a mapping of its own, given back when freed
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def give_back_large_buffers(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """mallopt(M_MMAP_THRESHOLD, threshold) for this process and the ones it forks; False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
