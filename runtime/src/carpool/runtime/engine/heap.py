"""Giving the engine's freed memory back to the operating system, so its resident size stays flat.

Every batch allocates activations of a different size (a packed batch is as long as its tokens; a
generation step as its sequences), and glibc's malloc raises its mmap threshold to the largest block
freed so far: after the first large batches, activations come from the heap, whose freed holes stay
resident. Measured with `bench.soak` (MiniLM, mixed traffic at 80% of saturation): the engine's RSS grew
from 481 to 781 MiB in three minutes and was still growing. Fixing the threshold
(`MALLOC_MMAP_THRESHOLD_=131072`) kept it flat but cost 35% of the throughput (every activation a fresh
mmap, zeroed page by page); `MALLOC_ARENA_MAX=2` changed nothing. `malloc_trim(0)` returns the free pages
inside the heap (`madvise(MADV_DONTNEED)`), not only its top: the engine calls it between batches, at most
once per `period_s`, in a thread that runs the model (it never waits for that thread's allocations).
Where the C library has no `malloc_trim` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


class HeapTrimmer:
    """Calls `malloc_trim(0)` after model work, at most once per `period_s` (pure timing, testable)."""

    def __init__(
        self,
        clock: Callable[[], float],
        period_s: float = 1.0,
        trim: Callable[[int], int] | None = None,
        available: bool = True,
    ) -> None:
        self.clock = clock
        self.period_s = period_s
        self._trim = trim if trim is not None else (_malloc_trim() if available else None)
        self._last = clock()
        self._lock = threading.Lock()  # every model thread calls after_work
        self.trims = 0

    def after_work(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            now = self.clock()
            if now - self._last < self.period_s:
                return
            self._last = now
            self.trims += 1
        self._trim(0)
