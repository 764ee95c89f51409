"""The engine hands freed heap pages back between batches (engine/heap.py): at most once per period."""

from __future__ import annotations

import sys

import pytest

from carpool.runtime.engine.heap import HeapTrimmer, _malloc_trim


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_per_period_after_work() -> None:
    clock = FakeClock()
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    trimmer = HeapTrimmer(clock, period_s=1.0, trim=trim)
    trimmer.after_work()  # right after start: not yet
    assert calls == []
    clock.now += 0.6
    trimmer.after_work()
    assert calls == []
    clock.now += 0.5  # 1.1 s since start
    trimmer.after_work()
    trimmer.after_work()  # the same instant: once
    assert calls == [0]
    clock.now += 0.9
    trimmer.after_work()
    assert calls == [0]
    clock.now += 0.2
    trimmer.after_work()
    assert calls == [0, 0] and trimmer.trims == 2


def test_without_malloc_trim_nothing_happens() -> None:
    clock = FakeClock()
    trimmer = HeapTrimmer(clock, available=False)
    clock.now += 10
    trimmer.after_work()
    assert trimmer.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is Linux-only")
def test_glibc_malloc_trim_is_found_and_callable() -> None:
    trim = _malloc_trim()
    assert trim is not None, "the engine would let its heap grow: malloc_trim not found in libc"
    assert trim(0) in (0, 1)
