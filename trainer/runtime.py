"""Process-level settings the engine relies on for speed (not for results).

glibc serves every allocation above 128 KiB with a fresh mmap and returns it on free, so
each training step would fault in and zero its activations page by page again. Raising
the mmap and trim thresholds keeps those blocks in the heap for reuse, which is what a
caching allocator does for PyTorch. Results do not depend on it.
"""

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_allocator() -> bool:
    """Apply the thresholds on glibc (idempotent); returns whether they were applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, for example): keep its defaults
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
