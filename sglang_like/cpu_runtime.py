"""CPU runtime hygiene: one OpenMP team for the engine's torch work, freed heap handed back."""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

logger = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # OpenMP 5.0 omp_pause_resource_t


@functools.lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch's wheel ships, if that is the one it uses."""
    import torch  # here: the HTTP process imports this module (trim_heap) without torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib",
                                              "libgomp*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            return lib if hasattr(lib, "omp_pause_resource_all") else None
        except OSError:
            continue
    return None


def release_openmp_threads() -> bool:
    """Let go of the calling thread's idle OpenMP worker threads (they come back if it runs a
    parallel op again). Returns whether a runtime took the request.

    GNU OpenMP counts every team's workers against the cores; once they outnumber the cores
    it spins only ~100 times before sleeping, so the engine thread's matmuls would each wait
    for a worker to wake up. Freeing the teams other threads made keeps the count at the core
    count.
    """
    lib = _libgomp()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(_OMP_PAUSE_HARD)
    if rc != 0:
        logger.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Return glibc's free heap pages to the OS (`malloc_trim`). Loading and a long prefill
    leave tens to hundreds of MB of freed temporaries in malloc's arenas, which would count as
    RSS for the life of the server; returns whether glibc took the call."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
