"""The engine hands freed heap pages back while idle (engine/heap.py): at most once per period, from its
busy loop's thread, never a model thread."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest

from carpool.runtime.engine import core as engine_core
from carpool.runtime.engine.heap import HeapTrimmer, _malloc_trim
from tests.runtime.conftest import ANSWER_S, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, factory


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _recorder(calls: list[int]) -> Callable[[int], int]:
    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    return trim


def test_trims_when_idle_at_most_once_per_period_after_work() -> None:
    clock = FakeClock()
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    trimmer = HeapTrimmer(clock, period_s=1.0, trim=trim, overdue_s=30.0)
    trimmer.worked()
    trimmer.turn(idle=True)  # right after start: not yet
    assert calls == []
    clock.now += 0.6
    trimmer.turn(idle=True)
    assert calls == []
    clock.now += 0.5  # 1.1 s since start
    trimmer.turn(idle=True)
    trimmer.turn(idle=True)  # the same instant: once
    assert calls == [0]
    clock.now += 5.0
    trimmer.turn(idle=True)  # idle, but no model work since the last trim: nothing to give back
    assert calls == [0]
    trimmer.worked()
    trimmer.turn(idle=True)
    assert calls == [0, 0] and trimmer.trims == 2


def test_under_constant_load_trims_only_when_overdue() -> None:
    """Busy turns (work running or waiting) do not trim within `overdue_s`: the trim would delay the
    next batch; past it, they do, so a never-idle engine's heap still stays flat."""
    clock = FakeClock()
    calls: list[int] = []
    trimmer = HeapTrimmer(clock, period_s=1.0, trim=_recorder(calls), overdue_s=30.0)
    for _ in range(29):
        clock.now += 1.0
        trimmer.worked()
        trimmer.turn(idle=False)
    assert calls == []
    clock.now += 1.5
    trimmer.turn(idle=False)
    assert calls == [0]


def test_without_malloc_trim_nothing_happens() -> None:
    clock = FakeClock()
    trimmer = HeapTrimmer(clock, available=False)
    clock.now += 10
    trimmer.worked()
    trimmer.turn(idle=True)
    assert trimmer.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is Linux-only")
def test_glibc_malloc_trim_is_found_and_callable() -> None:
    trim = _malloc_trim()
    assert trim is not None, "the engine would let its heap grow: malloc_trim not found in libc"
    assert trim(0) in (0, 1)


def test_the_engine_trims_its_heap_after_model_work_in_its_loop_not_a_model_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A served batch is followed, once the engine is idle, by a trim in the busy loop's thread (the
    trimmer's period set to 0 and its `malloc_trim` recorded): without the call the heap grows with every
    batch shape (see engine/heap.py), which no other test would notice; on a model thread it delays the
    next batch (issue 46)."""
    trims: list[str] = []

    def trim(pad: int) -> int:
        trims.append(threading.current_thread().name)
        return 1

    def trimmer(clock: Callable[[], float]) -> HeapTrimmer:
        return HeapTrimmer(clock, period_s=0.0, trim=trim)

    monkeypatch.setattr(engine_core, "HeapTrimmer", trimmer)
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    with serve(config, factory(ScriptedEngine())) as server:
        assert trims == []  # no model work yet
        answer = server.client.post("/v1/embeddings", json={"input": "hello world"}, timeout=ANSWER_S)
        assert answer.status_code == 200, answer.text
        wait_for(lambda: bool(trims), timeout=ANSWER_S, what="the engine trimming its heap after the batch")
        assert trims[0] == "carpool-engine-loop"  # the busy loop's thread, not a model thread
