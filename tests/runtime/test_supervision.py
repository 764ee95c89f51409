"""Faults outside the model call, injected into a running engine and front: a loop or task that stops
fails every request it held with 500 (never leaves it hanging), and the probes turn 503 at once.

Each test breaks one piece of bookkeeping on purpose (the model itself never fails here): the generation
core's step bookkeeping in the engine's loop, the engine's input and output threads, and a front's task
that reads the engine's outputs.
`test_processes.py` does the same in the real process layout and checks the exit codes. A generation that
runs past its deadline is likewise answered (504) rather than left running, and one whose client leaves
mid-stream is stopped and counted (499).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from carpool.runtime.api.process import DrainingServer
from carpool.runtime.batching.continuous import Sequence, StepPlan
from carpool.runtime.batching.request import ItemState
from carpool.runtime.engine.core import EngineCore
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.wire import Codec, EngineState
from tests.runtime.conftest import ANSWER_S, Running, answered, serve, stream_then_leave, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, factory


@pytest.fixture
def generator() -> Iterator[tuple[Running, ScriptedGenerator]]:
    engine = ScriptedGenerator()
    config = runtime_config(model={"name": "fake", "task": "generate"}, warmup={"enabled": False})
    with serve(config, factory(engine)) as running:
        yield running, engine
        engine.gate.set()


def test_an_error_in_the_generation_step_bookkeeping_fails_every_held_sequence_with_500(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    server, engine = generator
    task: Any = server.core.task

    def broken(plan: StepPlan, sampled: dict[int, int], seconds: float) -> None:
        raise RuntimeError("step bookkeeping bug on purpose")

    task.scheduler.complete = broken  # runs in the engine's loop after each step, outside the model
    engine.gate.clear()
    post = server.client.post
    with ThreadPoolExecutor(2) as pool:
        body = {"prompt": "hello", "max_tokens": 4}
        whole = pool.submit(post, "/v1/completions", json=body, timeout=ANSWER_S)
        wait_for(lambda: server.metric("carpool_running_sequences", model="fake") == 1, what="a step running")
        body = {"prompt": "world", "max_tokens": 4, "stream": True}
        streamed = pool.submit(post, "/v1/completions", json=body, timeout=ANSWER_S)
        wait_for(lambda: server.waiting() == 1, what="a second sequence queued")
        engine.gate.set()
        answers = (
            answered(whole, "the engine loop failed: a request it held must be answered 500"),
            answered(streamed, "the engine loop failed: an open stream must end with 500 (client._fail_all)"),
        )
        for answer in answers:
            assert answer.status_code == 500, answer.text
            message = answer.json()["error"]["message"]
            assert "engine failed while serving this request" in message
            assert "RuntimeError: step bookkeeping bug on purpose" in message
    assert server.core.state is EngineState.FAILED
    assert server.client.get("/v2/health/ready").status_code == 503
    live = server.client.get("/v2/health/live")
    assert live.status_code == 503 and "the engine loop stopped" in live.json()["error"]
    late = server.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1


def _broken(status: object) -> None:
    raise RuntimeError("reader bug on purpose")


def test_a_front_whose_engine_reader_stops_fails_what_it_held_and_stops_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The front exits as soon as it learns its reader stopped; the test holds that exit until it has
    # asked the probes (a front already gone would answer nothing, and a probe check could pass empty).
    probed = threading.Event()
    exit_when_broken = DrainingServer._exit_when_broken

    async def after_the_probes(self: DrainingServer) -> None:
        await self.service.client.broken.wait()
        await asyncio.to_thread(probed.wait, 30)
        await exit_when_broken(self)

    monkeypatch.setattr(DrainingServer, "_exit_when_broken", after_the_probes)
    engine = ScriptedEngine()
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    with serve(config, factory(engine), as_front=True) as server, ThreadPoolExecutor(1) as pool:
        engine.gate.clear()
        held = pool.submit(server.client.post, "/v1/embeddings", json={"input": "first"}, timeout=ANSWER_S)
        wait_for(lambda: server.metric("carpool_inflight_requests", model="fake") == 1, what="request held")
        # The engine's next heartbeat (within half a second) kills the reader task.
        server.service.client._on_status = _broken  # type: ignore[method-assign]
        answer = answered(held, "the front's reader stopped: the request it held must be answered 500")
        assert answer.status_code == 500, answer.text
        assert "carpool-engine-outputs stopped" in answer.json()["error"]["message"]
        # What the probes answer while the front is still up, then it stops with a non-zero exit.
        try:
            ready = server.client.get("/v2/health/ready", timeout=ANSWER_S)
            live = server.client.get("/v2/health/live", timeout=ANSWER_S)
        finally:
            probed.set()
        assert ready.status_code == 503, ready.text
        assert live.status_code == 503, (
            f"liveness must fail once the front cannot reach its engine: {live.text}"
        )
        assert "carpool-engine-outputs stopped" in live.json()["error"]
        front: Any = server.server
        wait_for(lambda: front.failed and front.should_exit, what="the front stopping")
        engine.gate.set()


def test_a_generation_running_past_its_deadline_gets_504_and_frees_its_slot(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    server, engine = generator
    engine.gate.clear()  # the first step holds: the sequence is running when its deadline passes
    body = {"prompt": "hello", "max_tokens": 100}
    headers = {"x-carpool-timeout": "0.5"}
    try:
        with ThreadPoolExecutor(1) as pool:
            post = server.client.post
            answer = pool.submit(post, "/v1/completions", json=body, headers=headers, timeout=ANSWER_S)
            wait_for(lambda: server.metric("carpool_running_sequences", model="fake") == 1, what="running")
            # answered at the deadline, though the step still holds
            result = answered(
                answer, "a running sequence must be stopped at its deadline (0.5 s) and get 504"
            )
    finally:
        engine.gate.set()
    assert result.status_code == 504, result.text
    assert "ran past its deadline" in result.json()["error"]["message"]
    wait_for(lambda: server.metric("carpool_running_sequences", model="fake") == 0, what="slot freed")
    assert server.metric("carpool_kv_cache_usage_ratio", model="fake") == 0.0
    assert server.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_a_generation_gets_a_deadline_of_minutes_by_default_that_a_caller_may_only_shorten(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    """With `batching.default_timeout_s` unset, a generation may stream for 300 s (an embedding gets 30 s):
    a long answer is not cut off at an encoder's deadline."""
    server, engine = generator
    task: Any = server.core.task
    scheduler = task.scheduler
    with ThreadPoolExecutor(1) as pool:
        for asked, expected in ((None, 300.0), ("1000", 300.0), ("120", 120.0)):
            engine.gate.clear()
            headers = {"x-carpool-timeout": asked} if asked else {}
            body = {"prompt": "hello", "max_tokens": 2}
            answer = pool.submit(server.client.post, "/v1/completions", json=body, headers=headers)
            wait_for(lambda: len(scheduler.running) == 1, what="running")
            running = scheduler.running[0]
            assert running.deadline - running.arrival == pytest.approx(expected, abs=1.0), asked
            engine.gate.set()
            assert answer.result(timeout=30).status_code == 200
            wait_for(lambda: not scheduler.running, what="finished")


def test_a_client_that_leaves_mid_stream_is_counted_499_and_its_sequence_stopped(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    """The engine's own record of the sequence (its scheduler's `Sequence`: state, tokens generated) says
    it stopped: an abort that only forgot the stream would leave it decoding for nobody, burning the device
    while every metric of answered requests looks right."""
    server, engine = generator
    stepped, hold = threading.Event(), threading.Event()
    step = engine.step
    seqs: list[Sequence] = []
    steps = 0

    def first_step_only(plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]:
        nonlocal steps
        if stepped.is_set():
            hold.wait(timeout=30)  # later steps wait: the stream is under way when the client leaves
        seqs.extend(w.seq for w in plan.work if w.seq not in seqs)
        steps += 1
        sampled = step(plan, params)
        stepped.set()
        return sampled

    engine.step = first_step_only  # type: ignore[method-assign]
    body = {"prompt": "hello", "max_tokens": 100, "stream": True}
    try:
        with stream_then_leave(server.url, body, timeout=30):
            pass  # the first token has been streamed; the second step holds
        wait_for(lambda: server.metric("carpool_requests_total", model="fake", status="499") == 1, what="499")
        (seq,) = seqs
        wait_for(
            lambda: seq.state.is_finished,
            timeout=ANSWER_S,
            what="the engine cancelling the sequence whose client left (GenerationCore.abort)",
        )
    finally:
        hold.set()
    wait_for(lambda: server.metric("carpool_running_sequences", model="fake") == 0, what="sequence stopped")
    assert seq.state is ItemState.CANCELLED, seq.state
    # one token, sampled before the client left; the step under way then is discarded, no step follows
    assert len(seq.output) == 1, f"the engine went on generating for nobody: {len(seq.output)} tokens"
    assert steps == 2
    assert server.metric("carpool_kv_cache_usage_ratio", model="fake") == 0.0
    assert server.metric("carpool_requests_total", model="fake", status="200") == 0


def test_an_engine_whose_input_thread_stops_fails_instead_of_ignoring_every_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(core: EngineCore) -> None:
        core._in_socket.close(linger=0)
        raise RuntimeError("input thread bug on purpose")

    monkeypatch.setattr(EngineCore, "_input_thread", broken)
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    with serve(config, factory(ScriptedEngine()), wait_ready=False) as server:
        wait_for(lambda: server.core.state is EngineState.FAILED, what="the engine failed")
        wait_for(lambda: not server.service.live, what="the front sees it")
        live = server.client.get("/v2/health/live")
        assert live.status_code == 503
        assert (
            "carpool-engine-input stopped: RuntimeError: input thread bug on purpose" in live.json()["error"]
        )
        assert server.client.get("/v2/health/ready").status_code == 503
        refused = server.client.post("/v1/embeddings", json={"input": "hello"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1


class _BreakableEncoder:
    """The engine's encoder of outputs for the fronts, raising once `broken` is set."""

    def __init__(self, encoder: Any, broken: threading.Event) -> None:
        self._encoder, self._broken = encoder, broken

    def encode(self, obj: object) -> bytes:
        if self._broken.is_set():
            raise RuntimeError("output thread bug on purpose")
        return bytes(self._encoder.encode(obj))


def test_an_engine_whose_output_thread_stops_fails_what_it_held_instead_of_leaving_it_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer of the held request dies with the output thread: the engine fails and stops, and the
    front, hearing nothing more, answers it 500 and turns its probes 503 (in a pod the front sees the
    engine process exit at once; here the engine is a thread, so its silence tells)."""
    broken = threading.Event()
    create = Codec.create

    def breakable() -> Codec:
        codec = create()
        codec.encoder = _BreakableEncoder(codec.encoder, broken)  # type: ignore[assignment]
        return codec

    monkeypatch.setattr(Codec, "create", staticmethod(breakable))
    engine = ScriptedEngine()
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    with serve(config, factory(engine), heartbeat_timeout_s=1.0) as server, ThreadPoolExecutor(1) as pool:
        engine.gate.clear()
        held = pool.submit(server.client.post, "/v1/embeddings", json={"input": "first"})
        wait_for(lambda: server.metric("carpool_inflight_requests", model="fake") == 1, what="request held")
        broken.set()
        engine.gate.set()  # the batch completes; sending its answer kills the output thread
        answer = held.result(timeout=30)
        assert answer.status_code == 500, answer.text
        assert "engine failed while serving this request" in answer.json()["error"]["message"]
        assert server.core.state is EngineState.FAILED
        assert "carpool-engine-output stopped: RuntimeError: output thread bug on purpose" in str(
            server.core._status.failure
        )
        assert server.client.get("/v2/health/live").status_code == 503
        refused = server.client.post("/v1/embeddings", json={"input": "late"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
