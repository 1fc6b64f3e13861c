"""Two heap settings for every serving process.

1. Python's garbage collector leaves the startup objects alone (`freeze_startup_objects`). A worker holds ~385,000
tracked objects once torch, transformers and the model are loaded, and one full collection walks them all:
~185 ms on the AVX2 EPYC, a stall for every running stream when it lands mid-step (the engine thread needs the
GIL between ops). gc.freeze() moves them to a permanent generation that collections skip, as vLLM does after
its engine starts; a full collection then takes microseconds. Only garbage made while serving is collected.

2. Keep the C heap's freed memory warm, so that KV messages land in pages that are already mapped.

Every KV chunk is a bytes object of up to a few MiB (768 KiB by default) on both ends of a transfer (grpcio
hands each message over as one). glibc serves a block that size with mmap() until a free has raised its dynamic
threshold, and gives the top of the heap back to the kernel once more than twice that threshold is free. Both
send the next message into fresh pages, and a first write to a fresh page costs more than the copy itself; raw
grpcio streaming into a process left at the defaults ran at a third of its speed with the heap kept (figures:
docs/architecture.md, "A warm heap").

So every pdserve process (and the benchmark's own processes, ceilings included) serves blocks under 32 MiB
(glibc's own upper bound for its dynamic threshold) from the heap and keeps up to 1 GiB of freed heap mapped,
as a serving process with jemalloc or tcmalloc would. The price is resident memory that stays at its peak.
A MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment wins; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)


def keep_heap_warm() -> bool:
    """Tune glibc's malloc as above; True if it was tuned here, False if left as it was."""
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    tuned = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD,
                                                                            TRIM_THRESHOLD_BYTES) == 1
    if not tuned:
        log.warning("mallopt refused the heap settings; KV messages may land in fresh pages")
    return tuned


def freeze_startup_objects() -> None:
    """Once loaded, before serving: collect the startup garbage, then exempt what survives from every later
    collection (1. above)."""
    gc.collect()
    gc.freeze()
