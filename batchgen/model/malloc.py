"""Keep freed memory in the process on glibc.

A decode step allocates and frees the same large tensors every step (logits of 128 rows x 32,000
are 16 MB; of 128 rows x 151,936, a Qwen2.5 vocabulary, 78 MB). glibc serves blocks above its mmap
threshold with fresh ``mmap`` calls and gives them back on free, so every step pays page faults to
touch that memory again: about a fifth of a CPU decode step on the bench model (77.5 -> 60.9 ms at
128 rows), and 20,000 faults a step for the 78 MB of logits. Raising the mmap and trim thresholds
keeps freed blocks in the heap for reuse, which is what an LD_PRELOAD of tcmalloc or jemalloc
achieves (the usual advice for CPU inference) without asking the user for one. The process then
holds its peak working set, which it needed anyway. Only the CPU runner calls this, with the
largest block its steps allocate (a step's logits); on other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 64 << 20  # blocks up to 64 MiB come from the heap (glibc's default cap: 32 MiB) ...
_MMAP_THRESHOLD_CAP = 512 << 20  # ... or up to the caller's largest block, at most this
_TRIM_THRESHOLD = 256 << 20  # up to 256 MiB (or twice the mmap threshold) of free heap is kept

_threshold = 0  # the mmap threshold set so far; 0: none


def keep_freed_memory(largest: int = 0) -> bool:
    """Raise glibc's mmap / trim thresholds so that blocks of up to ``largest`` bytes (at least
    64 MiB, at most 512 MiB) are served from the heap and kept there when freed; a later call
    with a larger ``largest`` raises them again. True when they are raised."""
    global _threshold
    want = min(max(_MMAP_THRESHOLD, _round_up(largest, 1 << 20)), _MMAP_THRESHOLD_CAP)
    if _threshold >= want:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, want) and mallopt(_M_TRIM_THRESHOLD, max(_TRIM_THRESHOLD, 2 * want)):
        _threshold = want
    return _threshold >= want


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
