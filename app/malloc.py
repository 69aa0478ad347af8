"""glibc's malloc asked to give freed memory back to the system, after a request that held large buffers.

glibc keeps freed memory in the arena of the thread that freed it, so every arena would keep its own largest
request. Bounded instead by admission's large-body slots calling trim() and by few_arenas() (set in the master
before the fork); a fixed mmap threshold bounded it too, but cost 15-25 % more CPU per image (bench/RESULTS.md,
"A shim worker's peak memory"). Elsewhere (not glibc) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

ARENAS = 2  # measured: bodies just under the gate, 12 MP each, 1,132 -> 518 MiB at the worker's peak
_M_ARENA_MAX = -8  # glibc's malloc.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def few_arenas(count: int = ARENAS) -> bool:
    """mallopt(M_ARENA_MAX, count) for this process and the ones it forks; False where not glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, count))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    function = getattr(_libc(), "malloc_trim", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def trim() -> bool:
    """malloc_trim(0): free memory of every arena back to the system; False where not glibc."""
    function = _malloc_trim()
    return bool(function(0)) if function is not None else False
