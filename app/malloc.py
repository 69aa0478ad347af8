"""glibc's malloc asked to give freed memory back to the system, after a request that held large buffers.

An upload (up to SHIM_MAX_UPLOAD_MB), its copies on the way to Triton and a decoded image (Pillow allocates it
in blocks of 16 MiB) are large buffers of one request. glibc keeps what is freed in the arena of the thread
that freed it (its mmap threshold rises to 32 MiB after the first such buffers), so every thread's arena
would keep its own largest request. Two bounds instead (measured in bench/RESULTS.md, "Memory"):
app/admission.py lets only LARGE_SLOTS bodies over LARGE_BODY_BYTES into a worker at once, and each of them,
when done, calls trim() (malloc_trim: every arena's free pages back to the system). A fixed mmap threshold
bounded it too, but made every batch tensor a fresh mapping, page-faulted on every request: 15-25 % more
shim CPU per image on the tensor routes. Elsewhere (not glibc) trim() does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def trim() -> bool:
    """malloc_trim(0): free memory of every arena back to the system; False where not glibc."""
    function = _malloc_trim()
    return bool(function(0)) if function is not None else False
