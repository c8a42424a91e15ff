"""glibc ``malloc`` thresholds for the engine's CPU tensors: a process setting.

A CPU fit allocates and frees intermediates of up to a few megabytes per operation. glibc
serves allocations above its ``mmap`` threshold with fresh pages and returns freed heap memory
above its trim threshold to the system, so the engine keeps paying page faults for memory it
just gave back. With the thresholds raised, freed blocks are reused instead (BENCHMARKS.md,
"Figures behind defaults"); the price: up to :data:`TRIM_THRESHOLD` of freed memory stays
with the process.

One arena (``M_ARENA_MAX`` 1): ``malloc_trim`` does not shrink the tops of the arenas glibc
gives contending threads, so what the server's threads freed (large request bodies, inflated
in parallel) stayed with the process; with one arena, and a trim after each large body, it
goes back.

The server (``pyhf-gpu-server``) and the Dask worker plugin apply it at start-up, with BLAS's
threads (:mod:`pyhf_gpu_server.blas`); a library user may call :func:`tune_cpu_allocator`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = [
    "ARENA_MAX",
    "MMAP_THRESHOLD",
    "TOP_PAD",
    "TRIM_THRESHOLD",
    "glibc_function",
    "tune_cpu_allocator",
]

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8

MMAP_THRESHOLD = 64 << 20
"""Allocations below this come from the heap (glibc's most for the main arena's heaps)."""
TRIM_THRESHOLD = 256 << 20
"""Freed memory at the top of the heap is returned to the system only beyond this."""
TOP_PAD = 64 << 20
"""The heap grows in steps of this."""
ARENA_MAX = 1
"""Arenas at most: the main one, which ``malloc_trim`` shrinks."""


def glibc_function(name: str):
    """The C library's function ``name`` (``mallopt``, ``malloc_trim``), or None off Linux,
    without a C library to load, or where it has no such function (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def tune_cpu_allocator() -> bool:
    """Raise glibc's ``malloc`` thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`,
    :data:`TOP_PAD`) and keep one arena (:data:`ARENA_MAX`); whether it applied (False off
    Linux or without glibc's ``mallopt``).

    >>> isinstance(tune_cpu_allocator(), bool)
    True
    """
    mallopt = glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
        (_M_ARENA_MAX, ARENA_MAX),
    )
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
