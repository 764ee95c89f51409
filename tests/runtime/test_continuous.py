"""Iteration-level scheduling rules, step by step with a fake clock: each test fails if its rule breaks."""

from __future__ import annotations

import math
import random

import pytest

from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
    StepPlan,
)
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import ItemState
from tests.runtime.factories import FakeClock


def seq(
    prompt: int = 4, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0, deadline: float = math.inf
) -> Sequence:
    return Sequence(
        tokens=list(range(prompt)),
        arrival=arrival,
        deadline=deadline,
        priority=priority,
        max_tokens=max_tokens,
    )


def scheduler(
    running: int = 4,
    step_tokens: int = 64,
    blocks: int = 64,
    block_size: int = 4,
    watermark: float = 1.0,
    late_after_s: float | None = None,
) -> IterationScheduler:
    return IterationScheduler(
        IterationPolicy(running, step_tokens, watermark),
        RequestQueue(100, 3, late_after_s),
        BlockAllocator(blocks, block_size),
    )


def run(s: IterationScheduler, plan: StepPlan, token: int = 7) -> None:
    """Pretend the model ran the step: every sequence that reached its end samples `token`."""
    s.complete(plan, {w.seq.seq: token for w in plan.work if w.sample}, seconds=0.01)


def test_a_new_sequence_is_prefilled_then_decoded_one_token_per_step() -> None:
    s = scheduler()
    a = seq(prompt=6)
    s.submit(a, 0.0)
    plan = s.schedule(0.0)
    assert [(w.seq, w.start, w.count) for w in plan.prefill] == [(a, 0, 6)] and plan.decode == []
    run(s, plan)
    assert a.output == [7] and a.computed == 6
    plan = s.schedule(0.1)
    assert [(w.seq, w.start, w.count) for w in plan.decode] == [(a, 6, 1)]


def test_sequences_join_the_running_batch_at_every_step() -> None:
    s = scheduler()
    a, b = seq(), seq()
    s.submit(a, 0.0)
    run(s, s.schedule(0.0))
    s.submit(b, 0.1)
    plan = s.schedule(0.1)
    assert [w.seq for w in plan.decode] == [a] and [w.seq for w in plan.prefill] == [b]


def test_finished_sequences_leave_at_once_and_free_their_blocks() -> None:
    s = scheduler()
    a, b = seq(), seq()
    s.submit(a, 0.0)
    s.submit(b, 0.0)
    run(s, s.schedule(0.0))
    used = s.allocator.used
    s.finish(a)
    assert s.allocator.used < used and a not in s.running
    assert [w.seq for w in s.schedule(0.1).decode] == [b]


def test_decode_goes_first_and_long_prompts_are_chunked_by_the_step_budget() -> None:
    s = scheduler(step_tokens=10)
    a = seq(prompt=3)
    s.submit(a, 0.0)
    run(s, s.schedule(0.0))
    long = seq(prompt=25)
    s.submit(long, 0.1)
    plan = s.schedule(0.1)
    assert [w.count for w in plan.decode] == [1]
    assert [(w.start, w.count, w.sample) for w in plan.prefill] == [(0, 9, False)]
    run(s, plan)
    plan = s.schedule(0.2)
    assert [(w.start, w.count) for w in plan.prefill] == [(9, 9)]
    run(s, plan)
    plan = s.schedule(0.3)
    assert [(w.start, w.count, w.sample) for w in plan.prefill] == [(18, 7, True)]
    assert plan.tokens <= 10


def test_no_more_than_max_running_sequences() -> None:
    s = scheduler(running=2)
    for _ in range(3):
        s.submit(seq(), 0.0)
    plan = s.schedule(0.0)
    assert len(plan.prefill) == 2 and s.waiting == 1


def test_admission_stops_when_the_cache_is_near_full() -> None:
    s = scheduler(blocks=10, block_size=4, watermark=0.5)  # admit while at most 5 of 10 blocks are used
    a, b = seq(prompt=16), seq(prompt=8)
    s.submit(a, 0.0)
    s.submit(b, 0.0)
    plan = s.schedule(0.0)
    assert [w.seq for w in plan.prefill] == [a]  # a takes 4 blocks; b would take 2 more: over 5
    assert s.waiting == 1


def test_out_of_cache_preempts_the_lowest_priority_most_recent_sequence() -> None:
    s = scheduler(blocks=6, block_size=4, running=4)
    old_low = seq(prompt=8, priority=0, arrival=0.0)
    high = seq(prompt=8, priority=2, arrival=0.1)
    new_low = seq(prompt=8, priority=0, arrival=0.2)
    for x in (old_low, high, new_low):
        s.submit(x, x.arrival)
    run(s, s.schedule(0.2))  # all three prefilled: 6 blocks, the pool is full
    assert s.allocator.free == 0
    plan = s.schedule(0.3)  # every sequence needs a 3rd block to decode its 9th token
    assert new_low in plan.preempted and high not in plan.preempted
    assert new_low.state is ItemState.WAITING and new_low.computed == 0 and new_low.blocks == []
    assert new_low.output == [7]  # kept: recomputed from prompt + output when readmitted
    assert {w.seq for w in plan.decode} <= {old_low, high}
    # Nobody else's blocks changed hands: the survivors' blocks are disjoint.
    assert not set(old_low.blocks) & set(high.blocks)


def test_a_preempted_sequence_keeps_its_turn_and_never_expires() -> None:
    s = scheduler(blocks=4, block_size=4, running=2)
    a = seq(prompt=8, arrival=0.0)
    b = seq(prompt=8, arrival=0.1, deadline=1.0)
    s.submit(a, 0.0)
    s.submit(b, 0.1)
    run(s, s.schedule(0.1))
    plan = s.schedule(0.2)
    assert plan.preempted == [b]
    late = seq(prompt=2, arrival=0.3)
    s.submit(late, 0.3)
    assert s.queue.candidates(1) == [b]
    assert s.schedule(5.0).expired == []


def test_past_the_ttft_objective_a_waiting_sequence_yields_but_a_preempted_one_keeps_its_turn() -> None:
    s = scheduler(blocks=4, block_size=4, running=2, late_after_s=1.0)
    a = seq(prompt=8, arrival=0.0)
    b = seq(prompt=8, arrival=0.1)
    s.submit(a, 0.0)
    s.submit(b, 0.1)
    run(s, s.schedule(0.1))
    plan = s.schedule(0.2)
    assert plan.preempted == [b]  # b had its first token: owed completion, not a second chance at TTFT
    waiting = seq(prompt=2, arrival=0.3)  # waits behind b, then past its 1 s objective
    fresh = seq(prompt=2, arrival=2.0)
    s.submit(waiting, 0.3)
    s.submit(fresh, 2.0)
    s.schedule(2.0)
    assert s.queue.candidates(3) == [b, fresh, waiting]


def test_expired_waiting_sequences_never_run() -> None:
    s = scheduler(running=1)
    a = seq()
    s.submit(a, 0.0)
    run(s, s.schedule(0.0))
    b = seq(deadline=0.5)
    s.submit(b, 0.1)
    plan = s.schedule(0.6)
    assert plan.expired == [b] and b.state is ItemState.EXPIRED
    assert b not in [w.seq for w in plan.work]


def test_higher_priority_is_admitted_first() -> None:
    s = scheduler(running=1)
    low, high = seq(priority=0), seq(priority=2)
    s.submit(low, 0.0)
    s.submit(high, 0.0)
    assert [w.seq for w in s.schedule(0.0).prefill] == [high]


def test_a_cancelled_running_sequence_frees_its_cache_within_one_step() -> None:
    s = scheduler()
    a, b = seq(), seq()
    s.submit(a, 0.0)
    s.submit(b, 0.0)
    run(s, s.schedule(0.0))
    before = s.allocator.used
    s.cancel(a)
    plan = s.schedule(0.1)
    assert [w.seq for w in plan.work] == [b]
    assert a.blocks == [] and s.allocator.used == len(b.blocks) < before + 1


def test_under_cache_pressure_every_sequence_finishes_with_its_full_output() -> None:
    # 8 sequences of 10 + 60 tokens need 8 x 18 blocks of 4; the pool has 40: preemption must happen, and
    # every sequence must still finish (no livelock) with exactly its own tokens.
    s = scheduler(running=8, step_tokens=32, blocks=40, block_size=4, watermark=0.9)
    seqs = [seq(prompt=10, max_tokens=60, arrival=k * 0.001) for k in range(8)]
    for k, x in enumerate(seqs):
        x.tokens = [k] * 10
        s.submit(x, x.arrival)
    steps = 0
    while s.running or s.waiting:
        plan = s.schedule(1.0)
        # The "model" samples the sequence's own id, so any mix-up shows in the outputs.
        s.complete(plan, {w.seq.seq: w.seq.tokens[0] for w in plan.work if w.sample}, seconds=0.01)
        for x in list(s.running):
            if len(x.output) >= x.max_tokens:
                s.finish(x)
        steps += 1
        assert steps < 5000, "no progress"
    assert s.preemptions > 0
    assert [x.output for x in seqs] == [[k] * 60 for k in range(8)]
    assert s.allocator.used == 0


def test_the_allocator_keeps_growing_sequences_contiguous_and_never_hands_out_a_block_twice() -> None:
    """Contiguous blocks let the engine attend without copying; sharing a block would mix two caches."""
    allocator = BlockAllocator(64, 4)
    a, b, c = seq(), seq(), seq()
    for tokens in range(4, 41, 4):  # three sequences decoding side by side, one block each per round
        for s in (a, b, c):
            assert allocator.grow(s, tokens)
    for s in (a, b, c):
        assert s.blocks == list(range(s.blocks[0], s.blocks[0] + 10))
    owned = a.blocks + b.blocks + c.blocks
    assert len(set(owned)) == len(owned) == allocator.used == 30

    allocator.release(b)  # a hole in the middle is reused, and nothing is handed out twice
    d = seq()
    assert allocator.grow(d, 4 * 34)
    owned = a.blocks + c.blocks + d.blocks
    assert len(set(owned)) == len(owned) == allocator.used == 54
    assert not allocator.grow(d, 4 * 45) and len(d.blocks) == 34  # short: nothing changes
    assert allocator.grow(d, 4 * 44) and allocator.free == 0


def drive(s: IterationScheduler, clock: FakeClock, steps: int = 200) -> list[StepPlan]:
    """Run steps until nothing runs or waits, finishing sequences at max_tokens; the plans, in order."""
    plans = []
    while s.running or s.waiting:
        plan = s.schedule(clock.advance(0.01))
        plans.append(plan)
        run(s, plan)
        for x in list(s.running):
            if len(x.output) >= x.max_tokens:
                s.finish(x)
        assert len(plans) < steps, "the scheduler stalled: sequences wait or run without progress"
    return plans


def test_a_prompt_longer_than_the_whole_cache_leaves_at_once_and_the_next_request_runs() -> None:
    """The issue's reproduction: a 40-token prompt against a 32-token cache used to be admitted, fail to
    grow, and hold the loop so that no later request ever ran."""
    clock = FakeClock()
    s = scheduler(blocks=8, block_size=4, step_tokens=64, watermark=0.9)
    oversized, small = seq(prompt=40, max_tokens=4), seq(prompt=4, max_tokens=4)
    s.submit(oversized, clock.now)
    s.submit(small, clock.now)
    plans = drive(s, clock)
    assert plans[0].truncated == [oversized] and oversized.output == []
    assert small.output == [7] * 4
    assert len(plans) == 4  # one prefill, three decodes: the small one never waited on the big one


def test_a_sequence_that_outgrows_the_cache_finishes_instead_of_stalling() -> None:
    clock = FakeClock()
    s = scheduler(blocks=8, block_size=4)  # 32 tokens
    long = seq(prompt=28, max_tokens=100)
    s.submit(long, clock.now)
    plans = drive(s, clock)
    truncated = [plan for plan in plans if plan.truncated]
    assert [plan.truncated for plan in truncated] == [[long]]
    assert len(long.output) == 32 - 28 + 1  # the token sampled after the last slot still counts
    assert s.allocator.used == 0


def test_a_first_prompt_larger_than_the_admission_watermark_is_still_admitted() -> None:
    """The watermark keeps room for running sequences to grow; with none running it must not keep a
    prompt out forever (a 30-token prompt against 0.5 x 32 tokens)."""
    clock = FakeClock()
    s = scheduler(blocks=8, block_size=4, watermark=0.5)
    a = seq(prompt=30, max_tokens=2)
    s.submit(a, clock.now)
    drive(s, clock)
    assert a.output == [7, 7]


@pytest.mark.parametrize("seed", range(20))
def test_any_mix_of_requests_that_fit_the_cache_all_finish(seed: int) -> None:
    """Random prompts, lengths and priorities that each fit the cache alone, against a cache far too small
    for all of them at once: every sequence finishes with its full output, whatever the interleaving."""
    rng = random.Random(seed)
    clock = FakeClock()
    s = scheduler(
        running=rng.randint(1, 6),
        step_tokens=rng.randint(6, 40),
        blocks=rng.randint(6, 16),
        block_size=rng.choice([1, 2, 4]),
        watermark=rng.choice([0.5, 0.9, 1.0]),
    )
    seqs = []
    for k in range(12):
        prompt = rng.randint(1, s.allocator.capacity - 1)
        x = seq(prompt, rng.randint(1, s.allocator.capacity - prompt), rng.randint(0, 2), k * 0.001)
        s.submit(x, x.arrival)
        seqs.append(x)
    drive(s, clock, steps=20_000)
    assert [len(x.output) for x in seqs] == [x.max_tokens for x in seqs]
    assert s.allocator.used == 0


def test_prefills_that_hold_every_block_make_room_instead_of_waiting_for_each_other() -> None:
    """Two prompts half prefilled, the pool full, neither able to continue: the most recent gives way
    (recomputed later) so the other can go on; skipping both would stall the loop for good."""
    clock = FakeClock()
    s = scheduler(blocks=8, block_size=4, running=2)
    a, b = seq(prompt=24, max_tokens=2, arrival=0.0), seq(prompt=24, max_tokens=2, arrival=0.001)
    for x in (a, b):
        s.submit(x, x.arrival)
        s.queue.take([x])
        s.running.append(x)
        assert s.allocator.grow(x, 16)
        x.computed = 16
    assert s.allocator.free == 0
    plan = s.schedule(clock.now)
    assert plan.preempted == [b] and [(w.seq, w.start) for w in plan.prefill] == [(a, 16)]
    drive(s, clock)
    assert a.output == b.output == [7, 7]
