"""Iteration-level scheduling rules, step by step with a fake clock: each test fails if its rule breaks."""

from __future__ import annotations

import math

from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
    StepPlan,
)
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import ItemState


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
    running: int = 4, step_tokens: int = 64, blocks: int = 64, block_size: int = 4, watermark: float = 1.0
) -> IterationScheduler:
    return IterationScheduler(
        IterationPolicy(running, step_tokens, watermark),
        RequestQueue(100, 3),
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
