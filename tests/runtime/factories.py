"""Factories for scheduler tests: inputs of a given length, priority and timing (after vLLM's
tests/v1/core/utils.py)."""

from __future__ import annotations

from typing import Any

from carpool.runtime.batching.former import FormationPolicy
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import WorkItem
from carpool.runtime.batching.scheduler import Scheduler
from carpool.runtime.config import RuntimeConfig


def item(length: int = 8, arrival: float = 0.0, deadline: float = 1e9, priority: int = 0) -> WorkItem:
    return WorkItem(tokens=list(range(length)), arrival=arrival, deadline=deadline, priority=priority)


def scheduler(
    max_queue_size: int = 1024, priority_levels: int = 3, late_after_s: float | None = None, **policy: object
) -> Scheduler:
    defaults: dict[str, object] = {"window_s": 0.0}
    defaults.update(policy)
    queue = RequestQueue(max_queue_size, priority_levels, late_after_s)
    return Scheduler(FormationPolicy(**defaults), queue)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def runtime_config(**sections: dict[str, Any]) -> RuntimeConfig:
    """A config from nested dicts, as a YAML file would give it (no environment variables read)."""
    return RuntimeConfig.model_validate(sections)


def streamed_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The `logprobs` of streamed /v1/completions chunks, concatenated field by field (what the whole
    answer's must equal)."""
    whole: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key in whole:
                whole[key] += (choice.get("logprobs") or {}).get(key) or []
    return whole
