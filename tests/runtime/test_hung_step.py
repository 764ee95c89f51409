"""A step that makes no progress fails the engine's liveness, though its heartbeat goes on.

A collective waiting on a rank that is gone blocks the model thread, not the engine's output thread: the
heartbeat keeps coming, so only the age of the running step (`Status.step_age_s`) shows the hang, and the
front's client fails the engine past `generation.step_timeout_s` (`/v2/health/live` then answers 503 and
the kubelet restarts the pod; under a LeaderWorkerSet, the group).

The engine core, its threads and sockets and the front's client are the real ones; the model is scripted
(`ScriptedEngine`) so that its forward pass can be held on a gate, as a hung collective holds vLLM's step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from carpool.runtime.api.client import EngineClient, hung_step
from carpool.runtime.errors import BatchFailed
from carpool.runtime.wire import EncodeRequest, EngineState, Status
from tests.runtime.fakes import ScriptedEngine
from tests.runtime.test_heartbeat import engine_serving


def test_a_step_is_hung_only_past_the_timeout_and_never_without_one() -> None:
    running = Status(EngineState.READY, 1, step_age_s=12.5)
    assert hung_step(running, 30.0) is None
    assert hung_step(Status(EngineState.READY, 1), 0.001) is None  # no step runs
    assert hung_step(running, None) is None  # generation.step_timeout_s: null turns it off
    reason = hung_step(running, 10.0)
    assert reason is not None and "step_timeout_s=10" in reason and "12s" in reason


async def test_a_hung_step_fails_the_engine_while_its_heartbeat_goes_on(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    with engine_serving(tmp_path, engine, 1) as (addresses, core):
        client = EngineClient(addresses, 0, heartbeat_timeout_s=2.0, step_timeout_s=0.5)
        await client.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while client.state is not EngineState.READY:
                assert loop.time() < deadline, "the engine did not turn ready"
                await asyncio.sleep(0.01)
            engine.gate.clear()  # the next forward pass hangs, as a collective missing a rank does
            request = EncodeRequest(client.next_rid(), 0, [[1, 2]], 0, 0.0, 1e9)
            answer = asyncio.create_task(client.encode(request))
            with pytest.raises(BatchFailed):  # 500: the engine failed while serving it
                await asyncio.wait_for(answer, timeout=30)
            assert client.dead is not None
            assert "without finishing (generation.step_timeout_s=0.5)" in client.dead, client.dead
            assert client.status is not None and client.status.step_age_s > 0.5  # the beat went on
            assert core.step_age() > 0.5
        finally:
            engine.gate.set()
            await client.close(goodbye=False)
