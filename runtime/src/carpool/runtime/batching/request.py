"""One input waiting to be batched, and its lifecycle."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
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


class TextPair(list[int]):
    """The token ids of a text pair (a query and a document for a cross-encoder), special tokens
    included: an input like any other to the batcher (its length, its budget), which also says where the
    second text begins, so the model gets token type 1 from `second` on."""

    __slots__ = ("second",)

    def __init__(self, ids: list[int], second: int) -> None:
        super().__init__(ids)
        self.second = second


def token_types(ids: Sequence[int]) -> list[int]:
    """The token type of each id: 0, and 1 from the second text of a `TextPair` on."""
    second = ids.second if isinstance(ids, TextPair) else len(ids)
    return [0] * second + [1] * (len(ids) - second)


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
    late: bool = False
    """It has waited past the objective and yields to its level's other inputs (`RequestQueue.age`)."""

    @property
    def length(self) -> int:
        return len(self.tokens)

    def order_key(self) -> tuple[int, int]:
        """Higher priority first, then arrival order (FIFO within a level)."""
        return (-self.priority, self.seq)
