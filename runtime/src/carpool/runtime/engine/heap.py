"""Giving the engine's freed memory back to the operating system, so its resident size stays flat.

Every batch allocates activations of a different size (a packed batch is as long as its tokens; a
generation step as its sequences), and glibc's malloc raises its mmap threshold to the largest block
freed so far: after the first large batches, activations come from the heap, whose freed holes stay
resident. Measured with `bench.soak` (MiniLM, mixed traffic at 80% of saturation): the engine's RSS grew
from 481 to 781 MiB in three minutes and was still growing. Fixing the threshold
(`MALLOC_MMAP_THRESHOLD_=131072`) kept it flat but cost 35% of the throughput (every activation a fresh
mmap, zeroed page by page); `MALLOC_ARENA_MAX=2` changed nothing. `malloc_trim(0)` returns the free pages
inside the heap (`madvise(MADV_DONTNEED)`), not only its top.

The engine's busy loop calls it, never a model thread, and only while the engine is idle (nothing runs,
nothing waits), at most once per `period_s`: it takes milliseconds (it walks every arena's free lists under
the arena's lock), and on a model thread, once a second, it delayed whatever batch came next, which at
moderate load is some request's tail (issue 46). Under load that never leaves the engine idle, it trims
anyway once `overdue_s` has passed since the last trim, so the heap stays flat at saturation too.
Where the C library has no `malloc_trim` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
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
    """Calls `malloc_trim(0)` when the engine is idle, at most once per `period_s`, or under constant load
    once per `overdue_s` (pure timing, testable). Called from the busy loop's thread only."""

    def __init__(
        self,
        clock: Callable[[], float],
        period_s: float = 1.0,
        trim: Callable[[int], int] | None = None,
        available: bool = True,
        overdue_s: float = 30.0,
    ) -> None:
        self.clock = clock
        self.period_s = period_s
        self.overdue_s = overdue_s
        self._trim = trim if trim is not None else (_malloc_trim() if available else None)
        self._last = clock()
        self._worked = False
        self.trims = 0

    def worked(self) -> None:
        """Model work has finished (its memory freed): the next trim has something to give back."""
        self._worked = True

    def turn(self, idle: bool) -> None:
        """After a turn of the busy loop; `idle`: nothing runs and nothing waits."""
        if self._trim is None or not self._worked:
            return
        now = self.clock()
        if now - self._last < (self.period_s if idle else self.overdue_s):
            return
        self._last = now
        self._worked = False
        self.trims += 1
        self._trim(0)
