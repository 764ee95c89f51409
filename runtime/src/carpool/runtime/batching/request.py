"""One input waiting to be batched, and its lifecycle."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

_sequence = itertools.count()


class ItemState(enum.IntEnum):
    """Ordered: every state from FINISHED on is terminal (as vLLM's RequestStatus)."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    EXPIRED = 3
    CANCELLED = 4
    FAILED = 5

    @property
    def is_finished(self) -> bool:
        return self >= ItemState.FINISHED


@dataclass(eq=False)
class WorkItem:
    """One model input (a single text) with what the scheduler needs to place it.

    `tokens` are the input ids, special tokens included and unpadded; `payload` is opaque to the
    scheduler (the driver keeps the caller's future there).
    """

    tokens: list[int]
    arrival: float
    deadline: float
    priority: int = 0
    payload: Any = None
    state: ItemState = ItemState.WAITING
    seq: int = field(default_factory=lambda: next(_sequence))

    @property
    def length(self) -> int:
        return len(self.tokens)

    def order_key(self) -> tuple[int, int]:
        """Higher priority first, then arrival order (FIFO within a level)."""
        return (-self.priority, self.seq)
