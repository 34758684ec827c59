"""The C allocator's settings for tensor work on Linux (glibc).

glibc's ``malloc`` serves every block above its mmap threshold with a fresh ``mmap`` and gives it back to the
system when freed (the threshold starts at 128 KiB and rises to the largest such block freed so far). PyTorch's CPU tensors come straight from ``malloc``, so every activation,
KV-cache buffer and gradient of a few MiB is new memory, and the first write to each of its 4 KiB pages is a page
fault: about 1 GB/s where a plain copy runs at several times that (docs/benchmarks.md has the measured effect).

:func:`keep_freed_memory` keeps blocks of up to 32 MiB on the heap, where a freed block is reused as it is, and lets
the heap hold on to what it has grown to (the resident memory stays near its peak instead of rising and falling with
every step). The ``mhgpo`` command calls it at start; a Python program may call it first thing. It leaves glibc's
defaults alone where the user has chosen an allocator (``LD_PRELOAD``) or glibc settings (``MALLOC_*_``,
``GLIBC_TUNABLES``), and where ``MHGPO_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap: glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top given back to the system only beyond this
TOP_PAD = 64 << 20  # the heap grows by at least this much at a time

_applied: bool | None = None


def user_chose_allocator(environ: Mapping[str, str] = os.environ) -> str | None:
    """The environment variable by which the user has chosen the allocator or its settings, else None."""
    if environ.get("MHGPO_MALLOC", "").lower() == "default":
        return "MHGPO_MALLOC"
    if "malloc" in environ.get("LD_PRELOAD", "").lower():  # jemalloc, tcmalloc, mimalloc...
        return "LD_PRELOAD"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    for name in environ:
        if name.startswith("MALLOC_") and name.endswith("_"):
            return name
    return None


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed blocks of up to 32 MiB for reuse (see the module's text); True where it is
    set (now or by an earlier call), False where it is left as it was: not Linux with glibc, or the user's own
    choice (:func:`user_chose_allocator`)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux") or user_chose_allocator() is not None:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no glibc parameters
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    return _applied
