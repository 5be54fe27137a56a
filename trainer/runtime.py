"""Process-level settings the engine relies on for speed (not for results).

glibc serves an allocation above 128 KiB with a fresh mmap and unmaps it on free, so each
training step would fault in and zero its activations page by page again. Kiln keeps those
blocks in the heap for reuse instead, which is what a caching allocator does for PyTorch:
- mmap for large blocks is turned off (M_MMAP_MAX 0), so every block comes from the heap:
  raising the mmap threshold, as Kiln did before, stops at glibc's largest (32 MiB), and the
  fused loss's logits chunks (about 64 MiB) above it were unmapped and faulted back in every
  chunk: about 1,600 faults and up to 0.4 s of kernel time per step at context 1024;
- glibc's automatic trimming is off (M_TRIM_THRESHOLD -1): it gives the heap's free top back
  to the kernel once it exceeds the threshold, and a step whose activations outgrew the old
  1 GiB one (about 1.6 GB at context 1024 for the SmolLM2-135M shape) freed them all at the
  end of backward, glibc trimmed, and the next step faulted hundreds of MB back in 4 KiB
  pages (about 180,000 faults, a second of a 3 s step).
`release_memory()` hands the free heap back explicitly (malloc_trim, which also releases
free pages inside the heap); a model's close() calls it, so a worker keeps no more than it
holds between jobs. Results do not depend on any of it.
"""

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = -1  # glibc stores the threshold as size_t: -1 is its largest value, so the heap top is never trimmed


@functools.cache
def _libc():
    """glibc's mallopt and malloc_trim, or None where the C library is not glibc (musl: keep its defaults)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return libc


def tune_allocator() -> bool:
    """Apply both settings on glibc (idempotent); returns whether they were applied."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def release_memory() -> bool:
    """Give the heap's free memory back to the kernel (glibc's malloc_trim); returns whether any was released."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
