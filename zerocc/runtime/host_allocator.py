"""Opt-in: tell glibc's malloc to keep freed host memory, so a functional step's fresh tensors reuse it.

A compiled step is functional: every gradient bucket, gathered parameter,
activation and updated optimizer state is a fresh tensor each step, freed
when the step is done with it. On CPU those are glibc ``malloc`` blocks.
glibc serves blocks above its mmap threshold with ``mmap`` and unmaps them
on ``free``, and trims the top of its heap once more than the trim
threshold is free; both return memory to the OS, so the next step's
tensors fault the same pages back in (a page fault and a page of zeros per
4 KiB). Eager PyTorch frees and reallocates too, but keeps parameters,
gradients and optimizer state in place between steps, so it pays less.

``keep_freed_host_memory()`` sets, through ``mallopt``, the thresholds that
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=... MALLOC_TOP_PAD_=268435456``
would set at start-up: blocks under 32 MiB come from the heap, the heap is
not trimmed below 2 GiB free, and it grows 256 MiB at a time.

The trade-off, why it is a function you call and not a default: it is a
setting of the whole process (every library's allocations, not only
zerocc's), memory freed stays in the process's resident set instead of going
back to the OS (up to the trim threshold: RSS does not shrink after a peak),
and it only exists on glibc (elsewhere the call does nothing and says so).
It changes no numerics. CUDA tensors are not concerned (PyTorch's caching
allocator already keeps their blocks).
"""
from __future__ import annotations

import ctypes
import ctypes.util

# glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3

MMAP_THRESHOLD_BYTES = 32 * 2**20      # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 2**31 - 1       # mallopt takes an int; the environment variable allows more
TOP_PAD_BYTES = 256 * 2**20


def keep_freed_host_memory(mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES,
                           top_pad: int = TOP_PAD_BYTES) -> bool:
    """Keep freed CPU memory in the process for reuse (glibc ``mallopt``); False where not glibc.

    Process-wide and lasting: call it once, before training. See the module's
    docstring for what it costs (the resident set keeps its high-water mark).
    """
    settings = ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold), (M_TOP_PAD, top_pad))
    for _, value in settings:
        if not isinstance(value, int) or not 0 <= value <= 2**31 - 1:
            raise ValueError(f"mallopt values are non-negative ints below 2**31, got {value!r}")
    libc = _glibc()
    if libc is None:
        return False
    for option, value in settings:
        if libc.mallopt(option, value) != 1:
            raise ValueError(f"glibc refused mallopt({option}, {value})")
    return True


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version   # only glibc has it: musl's or macOS's malloc know no such options
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
