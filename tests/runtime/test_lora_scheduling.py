"""Scheduling sequences that use LoRA adapters: at most max_loras distinct adapters run, admission waits
in order instead of thrashing the device, and no adapter starves another. Fake clock, no model."""

from __future__ import annotations

from typing import cast

from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
    StepPlan,
)
from carpool.runtime.batching.lora_admission import AdapterAdmission
from carpool.runtime.batching.queue import RequestQueue
from tests.runtime.factories import FakeClock


def scheduler(max_loras: int = 2, running: int = 8) -> IterationScheduler:
    return IterationScheduler(
        IterationPolicy(max_running_sequences=running, max_step_tokens=256),
        RequestQueue(1024, 3),
        BlockAllocator(1024, 16),
        AdapterAdmission(max_loras),
    )


def seq(adapter: str | None, now: float, tokens: int = 3, priority: int = 0) -> Sequence:
    return Sequence(
        tokens=[1, 2, 3, 4], arrival=now, deadline=1e9, priority=priority, max_tokens=tokens, adapter=adapter
    )


def step(sched: IterationScheduler, clock: FakeClock) -> StepPlan:
    """One step with every sampled token 7; finished sequences leave."""
    plan = sched.schedule(clock())
    sched.complete(plan, {w.seq.seq: 7 for w in plan.work if w.sample}, 0.01)
    for s in list(sched.running):
        if len(s.output) >= s.max_tokens:
            sched.finish(s)
    clock.advance(0.01)
    return plan


def test_a_step_never_holds_more_adapters_than_slots_and_base_requests_pass_a_waiting_head() -> None:
    sched, clock = scheduler(max_loras=2), FakeClock()
    for adapter in ["a", "b", "c", None, "a", None]:
        sched.submit(seq(adapter, clock()), clock())
    first = sched.schedule(clock())
    admitted = [w.seq.adapter for w in first.prefill]
    # "c" needs a third slot: it waits at the head; the base requests behind it pass, the "a" does not
    assert admitted == ["a", "b", None, None]
    assert [cast(Sequence, s).adapter for s in sched.queue.candidates(10)] == ["c", "a"]


def test_a_busy_adapter_does_not_starve_one_waiting_for_a_slot() -> None:
    """Adapters a and b get a new request every step for ever; c arrives once. With skip-ahead admission
    a and b would hold both slots for ever; here c runs within a few steps and a, b keep being served."""
    sched, clock = scheduler(max_loras=2), FakeClock()
    c = None
    c_ran_at: float | None = None
    served: dict[str | None, int] = {"a": 0, "b": 0, "c": 0, None: 0}
    for number in range(60):
        for adapter in ("a", "b"):
            sched.submit(seq(adapter, clock()), clock())
        if number == 5:
            c = seq("c", clock())
            sched.submit(c, clock())
        ran = {w.seq.adapter for w in step(sched, clock).work}
        assert len(ran - {None}) <= 2
        for name in ran:
            served[name] += 1
        if c is not None and c_ran_at is None and "c" in ran:
            c_ran_at = clock()
    assert c is not None and c_ran_at is not None, "the adapter that arrived last never ran"
    assert c_ran_at - c.arrival <= 0.1  # a few steps: the running a and b sequences finish (3 tokens)
    assert served["a"] > 30 and served["b"] > 30


def test_priority_comes_before_adapter_order_and_fifo_holds_within_a_level() -> None:
    sched, clock = scheduler(max_loras=1, running=1), FakeClock()
    first, urgent, second = seq("x", 0.0), seq("y", 0.0, priority=2), seq("x", 0.0)
    for s in (first, urgent, second):
        sched.submit(s, 0.0)
    order: list[Sequence] = []
    for _ in range(30):
        order.extend(w.seq for w in step(sched, clock).prefill if w.start == 0)
    assert order == [urgent, first, second]


def test_running_base_requests_hold_no_slot_from_an_adapter_that_waits_for_one() -> None:
    """Base-model sequences running take no adapter slot: with one slot and the base model busy, an
    adapter request is admitted at the next step instead of waiting for the base requests to finish."""
    sched, clock = scheduler(max_loras=1), FakeClock()
    base = [seq(None, clock(), tokens=50) for _ in range(3)]
    for s in base:
        sched.submit(s, clock())
    step(sched, clock)
    assert all(s in sched.running for s in base)
    adapter = seq("a", clock(), tokens=50)
    sched.submit(adapter, clock())
    admitted = [w.seq for w in step(sched, clock).prefill]
    assert admitted == [adapter], "an adapter request waited for a slot that running base requests hold"
    assert all(s in sched.running for s in base)
    # and the one slot is then held: a second adapter waits until "a" is done, base requests still join
    other, late_base = seq("b", clock()), seq(None, clock())
    sched.submit(other, clock())
    sched.submit(late_base, clock())
    assert [w.seq for w in step(sched, clock).prefill] == [late_base]
    assert other not in sched.running
    assert AdapterAdmission(1).pick([adapter], [base[0], base[1]]) == 0
