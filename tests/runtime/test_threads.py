"""Kernel names for carpool's threads (`carpool.runtime.threads`): what `top -H` and /proc show, and what the
benchmarks split a server's CPU by."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from carpool.runtime import threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="carpool names its threads only on Linux (prctl PR_SET_NAME)"
)


def _named(name: str) -> tuple[str, str]:
    """(kernel name, Python name) of a new thread after it calls name_thread(name)."""
    seen: list[tuple[str, str]] = []

    def run() -> None:
        threads.name_thread(name)
        seen.append((Path("/proc/thread-self/comm").read_text().strip(), threading.current_thread().name))

    thread = threading.Thread(target=run, name="python-name")
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_names_itself_for_the_kernel_and_keeps_its_python_name() -> None:
    assert _named(threads.LOOP) == ("carpool-loop", "python-name")
    assert _named("carpool-a-very-long-name") == ("carpool-a-very-", "python-name")  # 15 bytes at most


def test_only_the_model_instances_threads_count_as_the_models() -> None:
    assert [threads.model_thread(n) for n in range(3)] == [
        "carpool-engine",
        "carpool-model-1",
        "carpool-model-2",
    ]
    assert all(threads.is_model_thread(threads.model_thread(n)) for n in range(12))
    others = [
        threads.FRONT,
        threads.TOKENIZER,
        threads.LOOP,
        threads.INPUT,
        threads.OUTPUT,
        threads.LORA_READER,
    ]
    assert not any(threads.is_model_thread(name) for name in [*others, "ZMQbg/IO/0", "python"])
    assert all(len(name.encode()) <= 15 for name in [*others, threads.ENGINE, threads.model_thread(9)])


def test_a_pools_thread_carries_both_names() -> None:
    pool = threads.one_thread_pool("carpool-tokenize", threads.TOKENIZER)
    try:
        kernel, python = pool.submit(
            lambda: (Path("/proc/thread-self/comm").read_text().strip(), threading.current_thread().name)
        ).result(timeout=10)
    finally:
        pool.shutdown()
    assert kernel == "carpool-tokens" and python.startswith("carpool-tokenize")
