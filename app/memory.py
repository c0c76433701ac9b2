"""Give large freed blocks back to the operating system (glibc's malloc).

glibc serves allocations above its mmap threshold (128 KiB) with their own mappings,
returned to the system when freed; but each time such a block is freed it raises the
threshold to that block's size (up to 32 MiB). After a few multi-MiB outputs, every
later one comes from the heap, whose freed space is rarely handed back: a run that
produced a gibibyte, a few MiB at a time, left the process 150 MiB larger. Setting the
threshold explicitly turns that adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its default; False where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("not glibc's malloc: the mmap threshold is left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


# CPython 3.13's first threshold; 3.11's 700 runs a young collection every few requests.
GC_YOUNG_THRESHOLD = 2_000
# A full collection walks every object: at 10,000 streams that is most of a second with
# the event loop stopped. Nothing in Flowcast waits for one to free memory (runs break
# their own cycles), so they may be rare.
GC_FULL_EVERY = 100


def settle_gc() -> None:
    """Once startup is done: keep what it built (modules, routes, schemas) out of every
    later collection, and collect less often."""
    gc.collect()
    gc.freeze()
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, GC_FULL_EVERY)
