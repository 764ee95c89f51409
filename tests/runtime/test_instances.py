"""Model instances (`model.instances`): several batches of an encoder at once, the CPU threads shared out."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from carpool.runtime.engine.encoder import EncoderCore
from carpool.runtime.engine.instances import InstancePlan, InstancePool, plan_instances
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import EncodeOutput, EncodeRequest, EngineState
from tests.runtime.conftest import Running, answered, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, expected_embedding, factory


def test_the_default_is_two_instances_on_a_cpu_engine_with_two_threads_or_more() -> None:
    assert plan_instances(None, "cpu", 2) == InstancePlan(2, 2)
    assert plan_instances(None, "cpu", 16) == InstancePlan(2, 16)
    assert plan_instances(None, "cpu", 1) == InstancePlan(1, 1)
    # An engine that cannot divide its threads (a fake, the null engine) keeps one batch at a time.
    assert plan_instances(None, "cpu", 0) == InstancePlan(1, 0)
    assert plan_instances(None, "cuda:0", 0) == InstancePlan(1, 0)


def test_an_explicit_count_is_kept_and_refused_on_cuda() -> None:
    assert plan_instances(3, "cpu", 2) == InstancePlan(3, 2)
    assert plan_instances(1, "cpu", 8) == InstancePlan(1, 8)
    assert plan_instances(1, "cuda", 0) == InstancePlan(1, 0)
    with pytest.raises(ValueError, match=r"model\.instances 2 on cuda:1: one instance per GPU"):
        plan_instances(2, "cuda:1", 0)


def test_generation_refuses_more_than_one_instance() -> None:
    with pytest.raises(ValidationError, match=r"model\.instances 2: task generate runs one continuous batch"):
        runtime_config(model={"task": "generate", "instances": 2})
    assert runtime_config(model={"task": "generate", "instances": 1}).model.instances == 1
    assert runtime_config(model={"task": "rerank", "instances": 4}).model.instances == 4


def test_generation_refuses_more_than_one_engine_process() -> None:
    with pytest.raises(ValidationError, match=r"model\.processes 2: task generate runs one continuous batch"):
        runtime_config(model={"task": "generate", "processes": 2})
    assert runtime_config(model={"task": "embed", "processes": 4}).model.processes == 4


def test_a_batch_running_alone_gets_every_thread_and_one_beside_others_its_share() -> None:
    plan = InstancePlan(2, 8)
    assert plan.share(0) == 8
    assert plan.share(1) == 4
    assert plan.share(0, main=False) == 4  # alone, but not on the main thread
    assert InstancePlan(3, 2).share(2) == 1  # never below one thread
    assert InstancePlan(2, 0).share(1) == 0  # not a CPU engine: left alone
    assert InstancePlan(1, 8).share(0, main=False) == 8  # one instance: its one thread has them all
    chosen: list[int] = []
    pool = InstancePool(plan, chosen.append, on_main=lambda: True)
    with pool.slot() as first:
        with pool.slot() as second:
            assert (first, second) == (8, 4)
        with pool.slot() as third:  # the second has finished: one other still runs
            assert third == 4
    with pool.slot() as alone:
        assert alone == 8
    # Each batch with a share puts the engine's 8 back as it ends: a thread (the bench's main thread,
    # which runs an instance) never keeps a share and then plans its next run from it.
    assert chosen == [8, 4, 8, 4, 8, 8]


def test_only_the_main_thread_ever_takes_every_thread() -> None:
    """A batch that starts alone on another instance's thread (the main thread has just finished) keeps
    its share: a live thread that has once run a team of every thread slows the main thread's lone
    batches for as long as it lives (GNU OpenMP stops spinning; see `engine.instances`)."""
    pool = InstancePool(InstancePlan(2, 2), lambda threads: None)
    seen: list[int] = []

    def alone_elsewhere() -> None:
        with pool.slot() as threads:
            seen.append(threads)

    thread = threading.Thread(target=alone_elsewhere)
    thread.start()
    thread.join()
    with pool.slot() as threads:
        seen.append(threads)
    assert seen == [1, 2]  # alone both times: the instance thread its share, the main thread all


def test_a_lone_batch_takes_every_thread_one_with_work_behind_it_or_beside_it_its_share() -> None:
    """Placement at low load (issue 46): a batch alone with nothing behind it is latency, on every thread
    whatever its size (a lone request on one of two threads made the 1-client p50 9.6 ms worse,
    bench/RESULTS.md); with a backlog or another batch running, batches run side by side on their share."""
    plan = InstancePlan(2, 2)
    assert plan.threads_for([], waiting=0) == 2
    assert plan.threads_for([], waiting=3) == 1  # another batch starts behind it
    assert plan.threads_for([1], waiting=0) == 1  # another runs
    assert InstancePlan(2, 16).threads_for([], waiting=0) == 16
    assert InstancePlan(2, 16).threads_for([8], waiting=0) == 8
    assert InstancePlan(1, 8).threads_for([], waiting=5) == 8  # one instance: always every thread
    assert InstancePlan(2, 0).threads_for([], waiting=0) == 0  # not a CPU engine: left alone


def test_no_batch_starts_beside_one_that_holds_every_thread() -> None:
    """A second batch's thread would take a core the running team waits for at every operator's end."""
    plan = InstancePlan(2, 2)
    assert plan.may_start([])
    assert plan.may_start([1])  # beside a batch on its share: yes
    assert not plan.may_start([2])  # beside one on every thread: it waits for it
    assert not plan.may_start([1, 1])  # every instance busy
    assert InstancePlan(1, 2).may_start([]) and not InstancePlan(1, 2).may_start([2])
    assert InstancePlan(2, 0).may_start([0])  # no threads to share: only the instance count bounds it


def test_a_chosen_count_above_the_share_is_cut_to_it_off_the_main_thread() -> None:
    chosen: list[int] = []
    pool = InstancePool(InstancePlan(2, 2), chosen.append, on_main=lambda: False)
    with pool.slot(2) as threads:
        assert threads == 1  # a live thread that once ran every thread would slow the main thread's
    pool = InstancePool(InstancePlan(2, 2), chosen.append, on_main=lambda: True)
    with pool.slot(2) as threads:
        assert threads == 2
    with pool.slot(1) as threads:
        assert threads == 1
    assert chosen == [1, 2, 2, 1, 2]


class _ThreadedEngine(ScriptedEngine):
    """The scripted encoder, with CPU threads to share out (as MiniLM on torch's CPU threads)."""

    def __init__(self) -> None:
        super().__init__(max_input_tokens=512)
        self.used: list[int] = []

    def cpu_threads(self) -> int:
        return 2

    def use_cpu_threads(self, threads: int) -> None:
        self.used.append(threads)


def _request(rid: int, tokens: int) -> EncodeRequest:
    return EncodeRequest(rid, 0, [list(range(1, tokens + 1))], 0, 0.0, 1e9)


def test_the_encoder_holds_work_behind_a_batch_on_every_thread_then_splits_the_backlog() -> None:
    """The busy loop's view (`EncoderCore.schedule`, clock injected): a request alone runs on
    every thread; what comes while it runs waits for it instead of starting beside it; the backlog it
    leaves runs as two batches at once, each on its share."""
    clock = [0.0]
    config = runtime_config(
        model={"name": "fake"},
        batching={"max_batch_size": 1, "max_queue_size": 16, "batch_window_ms": 0},
    )
    core = EncoderCore(_ThreadedEngine(), config, RuntimeMetrics("fake"), clock=lambda: clock[0])
    assert core.instances == 2
    assert core.submit(_request(1, 8), 0.0) == []
    _, first, _ = core.schedule(0.0)
    assert first is not None and core._running == {id(core.scheduler.inflight[0]): 2}
    for rid in (2, 3):
        assert core.submit(_request(rid, 8), 0.0) == []
    assert core.schedule(0.0)[1] is None  # beside the all-thread batch: held
    assert core.scheduler.waiting == 2
    outputs = first.complete(first.run(), None)
    assert [out.rid for _, out in outputs if isinstance(out, EncodeOutput)] == [1]
    assert len(outputs) == 1
    _, second, _ = core.schedule(0.0)
    _, third, _ = core.schedule(0.0)
    assert second is not None and third is not None
    assert sorted(core._running.values()) == [1, 1]  # two at once, one thread each


def test_torch_threads_set_in_one_thread_leave_the_others_alone() -> None:
    """What `use_cpu_threads` relies on: OpenMP's thread count belongs to the thread that sets it."""
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []

    def instance() -> None:
        torch.set_num_threads(1)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=instance)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == before


def _config(instances: int | None) -> Any:
    return runtime_config(
        model={"name": "fake", "instances": instances},
        batching={"max_batch_size": 1, "max_queue_size": 16, "batch_window_ms": 0},
        warmup={"batch_sizes": [1], "sequence_lengths": [4]},
    )


def _post(running: Running, text: str) -> Any:
    return running.client.post("/v1/embeddings", json={"input": text})


def test_two_instances_run_two_batches_at_once_and_answer_each_request() -> None:
    engine = ScriptedEngine()
    with serve(_config(2), factory(engine)) as running, ThreadPoolExecutor(4) as pool:
        engine.entered = threading.Semaphore(0)  # forget warm-up's pass
        engine.gate.clear()
        texts = ["first text", "second text", "third text"]
        futures = [pool.submit(_post, running, text) for text in texts]
        # Batches of one input: two enter forward together and stay there; the third waits its turn.
        assert engine.entered.acquire(timeout=10)
        assert engine.entered.acquire(timeout=10), "the second batch did not start beside the first"
        wait_for(lambda: running.waiting() == 1, what="the third request queued")
        if sys.platform.startswith("linux"):  # the second instance's thread, as `top -H` shows it
            names = {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
            assert "carpool-model-1" in names, names
        engine.gate.set()
        for text, future in zip(texts, futures, strict=True):
            answer = answered(future, text)
            assert answer.status_code == 200
            assert answer.json()["data"][0]["embedding"] == expected_embedding(text)
    assert len(set(engine.threads)) >= 2  # the model ran in more than one thread
    assert running.core.state is EngineState.STOPPED  # drained on the way out: no instance left busy


def test_one_instance_runs_one_batch_at_a_time() -> None:
    engine = ScriptedEngine()
    with serve(_config(None), factory(engine)) as running, ThreadPoolExecutor(4) as pool:
        engine.entered = threading.Semaphore(0)
        engine.gate.clear()
        futures = [pool.submit(_post, running, text) for text in ("first text", "second text")]
        assert engine.entered.acquire(timeout=10)
        wait_for(lambda: running.waiting() == 1, what="the second request queued behind the first batch")
        engine.gate.set()
        assert [answered(f, "a request").status_code for f in futures] == [200, 200]
    assert len(set(engine.threads)) == 1


@pytest.mark.slow
def test_minilm_batches_run_concurrently_equal_the_same_batches_run_one_by_one() -> None:
    """The real encoder is safe to run from two threads at once: the same rows, bit for bit."""
    from carpool.runtime.engine.process import load_engine
    from carpool.runtime.models.base import CpuThreads
    from carpool.runtime.models.embedding import EmbeddingEngine

    engine = load_engine(runtime_config(model={"dtype": "float32"}))
    assert isinstance(engine, EmbeddingEngine) and isinstance(engine, CpuThreads)
    assert engine.cpu_threads() >= 1
    texts = [f"sentence number {k} about {'batching ' * (k % 7)}requests" for k in range(48)]
    batches = [engine.tokenize(texts[k : k + 8]) for k in range(0, len(texts), 8)]
    threads = engine.cpu_threads()
    engine.use_cpu_threads(1)
    try:
        alone = [np.stack(engine.forward(batch)) for batch in batches]
    finally:
        engine.use_cpu_threads(threads)  # this test's thread runs the next tests

    def run(batch: list[list[int]]) -> np.ndarray[Any, Any]:
        engine.use_cpu_threads(1)
        return np.stack(engine.forward(batch))

    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(run, batches * 3))
    for index, rows in enumerate(together):
        assert np.array_equal(rows, alone[index % len(batches)])
