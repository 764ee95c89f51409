"""Runs one batch on the model, in the worker thread, so that every input gets an outcome.

An out-of-memory error splits the batch in halves and retries each; only an input that fails alone is
answered with OutOfMemory. Any other exception fails the batch's inputs (and only those) with a message.
Inputs cancelled while waiting for the thread are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.runtime.batching.request import ItemState, WorkItem
from carpool.runtime.errors import BatchFailed, CarpoolError, OutOfMemory

log = logging.getLogger(__name__)

Forward = Callable[[Sequence[Sequence[int]]], Sequence[Any]]


@dataclass
class Outcome:
    output: Any = None
    error: CarpoolError | None = None


@dataclass
class BatchReport:
    outcomes: list[Outcome]
    oom_splits: int = 0


def run_batch(
    forward: Forward, items: Sequence[WorkItem], release_memory: Callable[[], None] = lambda: None
) -> BatchReport:
    """Run `items` through `forward`; the result lines up with `items` one for one."""
    report = BatchReport(outcomes=[Outcome() for _ in items])
    live = [i for i, item in enumerate(items) if item.state is not ItemState.CANCELLED]
    _run(forward, items, live, report, release_memory)
    return report


def _run(
    forward: Forward,
    items: Sequence[WorkItem],
    indices: list[int],
    report: BatchReport,
    release_memory: Callable[[], None],
) -> None:
    if not indices:
        return
    try:
        outputs = forward([items[i].tokens for i in indices])
    except (OutOfMemory, MemoryError):
        release_memory()
        if len(indices) == 1:
            length = items[indices[0]].length
            report.outcomes[indices[0]].error = OutOfMemory(
                f"out of memory running this input ({length} tokens) even in a batch of its own"
            )
            return
        report.oom_splits += 1
        half = len(indices) // 2
        log.warning(
            "out of memory on a batch of %d; retrying as %d + %d", len(indices), half, len(indices) - half
        )
        _run(forward, items, indices[:half], report, release_memory)
        _run(forward, items, indices[half:], report, release_memory)
        return
    except Exception as exc:
        log.exception("batch of %d failed", len(indices))
        error = BatchFailed(f"the model failed on this request's batch: {type(exc).__name__}: {exc}")
        for i in indices:
            report.outcomes[i].error = error
        return
    if len(outputs) != len(indices):
        error = BatchFailed(f"the model returned {len(outputs)} outputs for {len(indices)} inputs")
        for i in indices:
            report.outcomes[i].error = error
        return
    for i, output in zip(indices, outputs, strict=True):
        report.outcomes[i].output = output
