"""How the syncer's process allocates: large arrays straight from the kernel and back.

The syncer's big allocations come and go every merge: decoded pushes, the merged delta, the new
parameters, the encoded downloads and journal entries, each the size of a fragment's leaves. With
glibc's defaults a freed block raises the threshold above which blocks are mapped on their own
(up to 32 MiB), so later ones of the same size come from the heap arenas, one arena per thread
that allocated, and freed heap memory is kept for reuse. Measured on a 25M-parameter model
after three rounds of two learners' pushes: 35.7 bytes of resident memory per parameter above
the process's baseline with the defaults, 17 with a fixed 1 MiB mapping threshold, two arenas and
a 1 MiB trim threshold (docs/design.md, "Sharded syncer"). The merge time did not move beyond
the machine's noise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("diloco.syncer")

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
BIG = 1 << 20  # blocks of 1 MiB and more are mapped, and given back, on their own


def hold_less_memory() -> bool:
    """Tune glibc's malloc for the syncer (before any thread starts). False where the C library
    is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value) == 1
        for param, value in ((M_MMAP_THRESHOLD, BIG), (M_TRIM_THRESHOLD, BIG), (M_ARENA_MAX, 2))
    )
    log.debug("event=malloc_tuned ok=%s", ok)
    return ok
