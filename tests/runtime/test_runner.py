"""The batch runner: out-of-memory splitting, failure isolation, one outcome per input."""

from __future__ import annotations

from collections.abc import Sequence

from carpool.runtime.batching.request import ItemState
from carpool.runtime.batching.runner import run_batch
from carpool.runtime.errors import BatchFailed, OutOfMemory
from tests.runtime.factories import item


class MemoryLimitedModel:
    """Runs out of memory when a batch's padded tokens exceed `capacity` (an injected fault)."""

    def __init__(self, capacity: int, error: type[BaseException] = OutOfMemory) -> None:
        self.capacity = capacity
        self.error = error
        self.calls: list[int] = []
        self.released = 0

    def forward(self, batch: Sequence[Sequence[int]]) -> list[int]:
        self.calls.append(len(batch))
        if len(batch) * max(len(ids) for ids in batch) > self.capacity:
            raise self.error("out of memory") if self.error is not OutOfMemory else OutOfMemory("oom")
        return [len(ids) for ids in batch]

    def release(self) -> None:
        self.released += 1


def test_out_of_memory_splits_the_batch_in_halves_until_it_fits() -> None:
    model = MemoryLimitedModel(capacity=15)
    items = [item(5) for _ in range(8)]  # 40 padded tokens: fits only in quarters (10)
    report = run_batch(model.forward, items, model.release)
    assert [o.output for o in report.outcomes] == [5] * 8
    assert all(o.error is None for o in report.outcomes)
    assert model.calls == [8, 4, 2, 2, 4, 2, 2]
    assert report.oom_splits == 3 and model.released == 3


def test_python_memory_error_is_treated_as_out_of_memory() -> None:
    model = MemoryLimitedModel(capacity=10, error=MemoryError)
    report = run_batch(model.forward, [item(5), item(5), item(5), item(5)], model.release)
    assert [o.output for o in report.outcomes] == [5, 5, 5, 5]


def test_only_an_input_that_does_not_fit_alone_fails() -> None:
    model = MemoryLimitedModel(capacity=30)
    items = [item(5), item(40), item(5), item(5)]
    report = run_batch(model.forward, items, model.release)
    assert [o.output for o in report.outcomes] == [5, None, 5, 5]
    error = report.outcomes[1].error
    assert isinstance(error, OutOfMemory) and "40 tokens" in error.message


def test_a_model_exception_fails_that_batch_with_a_message() -> None:
    def broken(batch: Sequence[Sequence[int]]) -> list[int]:
        raise RuntimeError("CUDA error: device-side assert triggered")

    report = run_batch(broken, [item(), item()])
    errors = [o.error for o in report.outcomes]
    assert all(isinstance(e, BatchFailed) for e in errors)
    assert "device-side assert" in errors[0].message  # type: ignore[union-attr]


def test_output_count_mismatch_is_an_error_not_a_mix_up() -> None:
    report = run_batch(lambda batch: [1], [item(), item()])
    assert all(isinstance(o.error, BatchFailed) for o in report.outcomes)


def test_cancelled_inputs_are_skipped() -> None:
    seen: list[int] = []

    def forward(batch: Sequence[Sequence[int]]) -> list[int]:
        seen.append(len(batch))
        return [len(ids) for ids in batch]

    a, b = item(3), item(4)
    a.state = ItemState.CANCELLED
    report = run_batch(forward, [a, b])
    assert seen == [1]
    assert report.outcomes[1].output == 4 and report.outcomes[0].output is None
