"""Which waiting sequence may join the running batch when sequences use LoRA adapters. Pure.

The device holds `max_loras` adapters, so the running sequences together use at most that many distinct
adapters (the base model needs no slot). A sequence whose adapter is already running, or that uses
none, joins as any other; one that needs a new adapter joins only while a slot is free.

When the head of the queue (highest priority, oldest) needs an adapter and no slot is free, admission
waits: nothing behind it that needs an adapter is admitted, not even for an adapter already running, so
the running adapters drain and the head takes the first slot freed. Admitting those behind it instead
would keep busy adapters busy for ever and starve the head's (vLLM's skip-ahead has that failure);
swapping the head's adapter in by preempting running sequences would thrash the device cache.
Base-model sequences behind a waiting head are admitted: they hold no slot, so they delay no one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import WorkItem

LOOKAHEAD = 64
"""Waiting sequences looked at past a head that waits (bounds the work of one admission)."""


class _HasAdapter(Protocol):
    @property
    def adapter(self) -> str | None: ...


@dataclass(frozen=True)
class AdapterAdmission:
    """Caps the distinct adapters among running sequences at `max_loras`."""

    max_loras: int

    def pick(self, waiting: Iterable[_HasAdapter], running: Iterable[_HasAdapter]) -> int | None:
        """Index (into `waiting`, in queue order) of the next sequence to admit, or None to wait."""
        in_use = {seq.adapter for seq in running if seq.adapter is not None}
        for index, seq in enumerate(waiting):
            if seq.adapter is None:
                return index
            if index == 0 and (seq.adapter in in_use or len(in_use) < self.max_loras):
                return 0
        return None

    def next(self, queue: RequestQueue, running: Sequence[_HasAdapter]) -> list[WorkItem]:
        """The next sequence to admit as a one-item list (the form `queue.candidates` gives), or []."""
        waiting = queue.candidates(LOOKAHEAD)
        index = self.pick(waiting, running)  # type: ignore[arg-type]
        return [] if index is None else [waiting[index]]
