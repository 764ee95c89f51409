"""Iteration-level scheduling for text generation. Pure: no clock, no threads, no torch.

Every step, `schedule(now)` decides which sequences advance and by how many tokens:

1. Waiting sequences past their deadline leave (answered 504, never run). Cancelled sequences leave
   and free their cache blocks.
2. Decode first: every running sequence that is caught up gets one token of the step's budget, highest
   priority first. If the KV cache has no block for it, the lowest-priority, most recent running sequence
   is preempted: its blocks are freed and it goes back to the head of its queue with its tokens so far, to
   be recomputed later (it may be the sequence itself). No other sequence's cache is touched.
3. Prefills in progress continue, chunked to what is left of the budget and of the free blocks; one that
   finds no free block at all makes room the same way, so prefills never wait on each other forever.
4. Waiting sequences are admitted (priority order, FIFO within a level; with a latency objective, those
   that have waited past it after the rest of their level: `queue`) while fewer than
   `max_running_sequences` run, budget is left, and the cache stays under `admit_watermark` full. With
   nothing running the watermark does not apply: the whole cache is the head sequence's.

A sequence longer than the whole cache (prompt and output) could never run: it leaves in
`plan.truncated` (the driver finishes it by length, or refuses a prompt that never produced a token)
rather than stalling the loop. The service's admission check (`batching.admission`) refuses such
requests before they are queued; this is the backstop.

The driver then runs the step and calls `complete(plan, tokens)`, and `finish(seq)` when a sequence
is done (end of text, stop string, max tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import cast

from carpool.runtime.batching.lora_admission import AdapterAdmission
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import ItemState, WorkItem
from carpool.runtime.batching.throughput import ThroughputMeter
from carpool.runtime.errors import QueueFull


@dataclass(eq=False)
class Sequence(WorkItem):
    """A generation request: `tokens` is the prompt; `output` grows by one token per decode step."""

    max_tokens: int = 16
    output: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens (prompt and output) whose keys and values are in the cache."""
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    adapter: str | None = None
    """The LoRA adapter it runs with; None for the base model."""

    @property
    def total(self) -> int:
        return len(self.tokens) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens to run through the model before the next one can be sampled."""
        return self.total - self.computed

    def all_tokens(self) -> list[int]:
        return self.tokens + self.output


class BlockAllocator:
    """Fixed pool of KV cache blocks of `block_size` tokens.

    Any blocks serve, but contiguous ones are faster: the engine attends over a sequence whose blocks
    follow each other as one range of the pool, without copying it. So a growing sequence takes the
    block after its last one when that is free, and one that must start a new run starts it in the
    middle of the largest free run, leaving the sequence before that run room to grow.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._map = bytearray(b"\x01" * num_blocks)  # 1 = free
        self._free = num_blocks

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.num_blocks - self._free

    def usage(self) -> float:
        return self.used / self.num_blocks

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds: the longest any one sequence can grow."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def room_for(self, seq: Sequence) -> int:
        """Tokens `seq` can still compute: the rest of its blocks plus every free block."""
        return (len(seq.blocks) + self._free) * self.block_size - seq.computed

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Give `seq` blocks for `tokens` tokens in all; False (and nothing changed) if the pool is short."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need > self._free:
            return False
        for _ in range(max(0, need)):
            block = self._next_block(seq.blocks)
            self._map[block] = 0
            seq.blocks.append(block)
            self._free -= 1
        return True

    def release(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self._map[block] = 1
        self._free += len(seq.blocks)
        seq.blocks = []

    def _next_block(self, blocks: list[int]) -> int:
        if blocks and blocks[-1] + 1 < self.num_blocks and self._map[blocks[-1] + 1]:
            return blocks[-1] + 1
        runs = (match.span() for match in _FREE_RUN.finditer(self._map))
        start, stop = max(runs, key=lambda span: span[1] - span[0])
        return start if start == 0 else start + (stop - start) // 2


_FREE_RUN = re.compile(b"\x01+")


@dataclass
class Work:
    """Run `count` tokens of `seq` starting at position `start`; sample after them if `sample`."""

    seq: Sequence
    start: int
    count: int

    @property
    def sample(self) -> bool:
        return self.start + self.count == self.seq.total


@dataclass
class StepPlan:
    decode: list[Work] = field(default_factory=list)
    prefill: list[Work] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    truncated: list[Sequence] = field(default_factory=list)
    """Sequences that outgrew the whole KV cache: finished now, by length (or refused if they never
    produced a token). The service's admission check keeps such requests out; this is the backstop."""

    @property
    def work(self) -> list[Work]:
        return self.decode + self.prefill

    @property
    def tokens(self) -> int:
        return sum(w.count for w in self.work)


@dataclass(frozen=True)
class IterationPolicy:
    max_running_sequences: int = 16
    max_step_tokens: int = 512
    admit_watermark: float = 0.9


class IterationScheduler:
    """Decides every step of continuous batching."""

    def __init__(
        self,
        policy: IterationPolicy,
        queue: RequestQueue,
        allocator: BlockAllocator,
        adapters: AdapterAdmission | None = None,
    ) -> None:
        if policy.max_step_tokens < policy.max_running_sequences:
            raise ValueError(
                f"max_step_tokens ({policy.max_step_tokens}) must be at least max_running_sequences "
                f"({policy.max_running_sequences}) so every running sequence can decode each step"
            )
        self.policy = policy
        self.queue = queue
        self.allocator = allocator
        self.adapters = adapters
        """With LoRA adapters: at most max_loras distinct ones run (see `lora_admission`)."""
        self.running: list[Sequence] = []
        self.throughput = ThroughputMeter()
        self.preemptions = 0

    def submit(self, seq: Sequence, now: float) -> None:
        if self.queue.free_slots() < 1:
            raise QueueFull(
                f"queue full: {len(self.queue)} requests waiting (limit {self.queue.max_size}); retry later",
                retry_after_s=self.retry_after_s(),
            )
        self.queue.push([seq])

    def cancel(self, seq: Sequence) -> None:
        """Withdraw a sequence; a running one leaves at the next step and frees its cache."""
        if seq.state is ItemState.WAITING:
            self.queue.remove(seq)
        if not seq.state.is_finished:
            seq.state = ItemState.CANCELLED

    def finish(self, seq: Sequence, state: ItemState = ItemState.FINISHED) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.release(seq)
        if not seq.state.is_finished:
            seq.state = state

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(expired=[cast(Sequence, seq) for seq in self.queue.expire(now)])
        self.queue.age(now)
        for seq in [s for s in self.running if s.state is not ItemState.RUNNING]:
            self.running.remove(seq)
            self.allocator.release(seq)
        self.running.sort(key=WorkItem.order_key)
        for seq in list(self.running):
            if seq.pending != 1 or seq not in self.running:
                continue
            if seq.total > self.allocator.capacity:
                self._truncate(seq, plan)  # the next token has no slot even in an empty cache
                continue
            while seq in self.running and not self.allocator.grow(seq, seq.total):
                self._preempt(plan)
            if seq in self.running:
                plan.decode.append(Work(seq, seq.computed, 1))
        for seq in list(self.running):
            budget = self.policy.max_step_tokens - plan.tokens
            if seq not in self.running or seq.pending <= 1 or budget <= 0:
                continue
            # A chunk as large as the budget and the free blocks allow; with no block free at all, the
            # lowest-priority, most recent sequence (perhaps this one) makes room, so that a prefill
            # short of blocks can never hold the loop with nothing running.
            while seq in self.running:
                count = min(seq.pending, budget, self.allocator.room_for(seq))
                if count >= 1:
                    self.allocator.grow(seq, seq.computed + count)
                    plan.prefill.append(Work(seq, seq.computed, count))
                    break
                self._preempt(plan)
                budget = self.policy.max_step_tokens - plan.tokens
        while len(self.running) < self.policy.max_running_sequences:
            budget = self.policy.max_step_tokens - plan.tokens
            head = (
                self.queue.candidates(1)
                if self.adapters is None
                else self.adapters.next(self.queue, self.running)
            )
            if budget <= 0 or not head:
                break
            seq = cast(Sequence, head[0])
            if seq.total > self.allocator.capacity:
                self.queue.take([seq])  # it could never fit: answer it rather than wait forever
                self._truncate(seq, plan)
                continue
            count = min(seq.pending, budget)
            if self.running:
                limit = self.policy.admit_watermark * self.allocator.num_blocks
                if self.allocator.used + self.allocator.blocks_for(count) > limit:
                    break
            else:
                # Nothing runs: the watermark keeps room for running sequences to grow, and there are
                # none. The whole (empty) cache is this sequence's, in chunks it can hold.
                count = min(count, self.allocator.capacity)
            self.queue.take([seq])
            self.allocator.grow(seq, count)
            self.running.append(seq)
            plan.prefill.append(Work(seq, seq.computed, count))
        return plan

    def _preempt(self, plan: StepPlan) -> None:
        victim = self._preempt_victim()
        plan.preempted.append(victim)
        plan.decode = [w for w in plan.decode if w.seq is not victim]
        plan.prefill = [w for w in plan.prefill if w.seq is not victim]

    def _truncate(self, seq: Sequence, plan: StepPlan) -> None:
        """`seq` has outgrown the whole cache: it leaves now (finish reason `length` for the driver, or
        refused if it never produced a token)."""
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.release(seq)
        seq.state = ItemState.FINISHED
        plan.truncated.append(seq)

    def _preempt_victim(self) -> Sequence:
        victim = min(self.running, key=lambda s: (s.priority, -s.arrival, -s.seq))
        self.running.remove(victim)
        self.allocator.release(victim)
        victim.computed = 0
        victim.preemptions += 1
        victim.deadline = math.inf  # it was admitted once: it is owed completion, not a timeout
        self.queue.push_front(victim)
        self.preemptions += 1
        return victim

    def complete(self, plan: StepPlan, sampled: dict[int, int], seconds: float) -> None:
        """The step ran: advance each sequence and append the token sampled for it (keyed by seq id)."""
        for work in plan.work:
            seq = work.seq
            if seq.state is not ItemState.RUNNING:
                continue
            seq.computed = work.start + work.count
            token = sampled.get(seq.seq)
            if token is not None:
                seq.output.append(token)
        self.throughput.record(plan.tokens, seconds)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def kv_usage(self) -> float:
        return self.allocator.usage()

    def backlog_seconds(self) -> float:
        return self.throughput.seconds_for(self.queue.tokens)

    def retry_after_s(self) -> float:
        return float(max(1, math.ceil(self.backlog_seconds())))
