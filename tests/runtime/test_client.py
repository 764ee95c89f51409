"""The front's door to the engine (`api.client.EngineClient`) over real ZeroMQ sockets, with a bare PULL
socket standing in for the engine's input (the full engine is behind every other runtime test): the
requests of one event-loop turn travel in one frame, in the order they were made, an abort never overtakes
its request, and a frame that cannot be sent fails its requests instead of leaving them waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from carpool.runtime.api.client import EngineClient, combined
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.errors import NotReady
from carpool.runtime.wire import (
    Abort,
    Addresses,
    Codec,
    EncodeOutput,
    EncodeRequest,
    EngineState,
    FrontMessage,
    Goodbye,
    Status,
)
from tests.runtime.factories import runtime_config


class EngineInput:
    """The engine's end of the front's PUSH socket: each frame decoded as the engine decodes it."""

    def __init__(self, address: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.bind(address)
        self.codec = Codec.create()

    async def frame(self) -> list[FrontMessage]:
        data = await asyncio.wait_for(self.socket.recv(), timeout=5)
        return self.codec.front_decoder.decode(data)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
async def wired(tmp_path: Path) -> AsyncIterator[tuple[EngineClient, EngineInput]]:
    addresses = Addresses.in_folder(str(tmp_path), 1)
    engine = EngineInput(addresses.input)
    client = EngineClient(addresses, 0)
    await client.start()
    try:
        yield client, engine
    finally:
        await client.close()
        engine.close()


def request(client: EngineClient, tokens: int) -> EncodeRequest:
    return EncodeRequest(client.next_rid(), 0, [[1] * tokens], 0, 0.0, 1e9)


async def test_requests_of_one_loop_turn_share_a_frame_and_an_abort_follows_its_request(
    wired: tuple[EngineClient, EngineInput],
) -> None:
    client, engine = wired
    first, second, third = (request(client, n) for n in (1, 2, 3))
    waits = [asyncio.create_task(client.encode(r)) for r in (first, second, third)]
    assert await engine.frame() == [first, second, third]

    waits[1].cancel()  # the caller left: the engine must learn it, after the request itself
    late = request(client, 4)
    waits.append(asyncio.create_task(client.encode(late)))
    assert await engine.frame() == [Abort([second.rid]), late]

    # The answers still reach the requests that wait (the engine's PUSH to this front's output).
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(client.addresses.outputs[0])
    rows = [EncodeOutput(r.rid, "float32", (1, 1), b"\0" * 4) for r in (first, third, late)]
    push.send(engine.codec.encoder.encode(rows))
    answers = await asyncio.wait_for(asyncio.gather(waits[0], waits[2], waits[3]), timeout=5)
    assert [a.rid for a in answers] == [first.rid, third.rid, late.rid]
    push.close(linger=0)
    with pytest.raises(asyncio.CancelledError):
        await waits[1]


async def test_a_request_sent_alone_goes_at_once_and_goodbye_comes_last(
    wired: tuple[EngineClient, EngineInput],
) -> None:
    client, engine = wired
    alone = request(client, 5)
    wait = asyncio.create_task(client.encode(alone))
    assert await engine.frame() == [alone]
    queued = request(client, 6)
    waits_too = asyncio.create_task(client.encode(queued))
    await asyncio.sleep(0)  # queued for the loop's next turn, which close() does not wait for
    await client.close()
    assert await engine.frame() == [queued, Goodbye(0)]  # nothing queued is left behind the goodbye
    for task in (wait, waits_too):
        with pytest.raises(NotReady, match="the server stopped"):
            await task


async def test_a_frame_that_cannot_be_sent_fails_its_requests_instead_of_leaving_them_waiting(
    wired: tuple[EngineClient, EngineInput],
) -> None:
    client, _ = wired
    client._pushes[0].close(linger=0)  # the socket goes away under the front (what a torn-down context does)
    with pytest.raises(NotReady, match="could not reach the model engine"):
        await asyncio.wait_for(client.encode(request(client, 1)), timeout=5)


@pytest.fixture
async def two_engines(tmp_path: Path) -> AsyncIterator[tuple[EngineClient, list[EngineInput]]]:
    addresses = Addresses.in_folder(str(tmp_path), 1, engines=2)
    engines = [EngineInput(addresses.engine_input(k)) for k in range(2)]
    client = EngineClient(addresses, 0)
    await client.start()
    try:
        yield client, engines
    finally:
        await client.close()
        for engine in engines:
            engine.close()


def inputs(client: EngineClient, count: int) -> EncodeRequest:
    return EncodeRequest(client.next_rid(), 0, [[1, 2]] * count, 0, 0.0, 1e9)


async def test_with_two_engine_processes_a_request_goes_to_the_one_with_fewer_inputs_outstanding(
    two_engines: tuple[EngineClient, list[EngineInput]],
) -> None:
    """`model.processes 2`: the front balances its inputs over the engines; an abort goes where its
    request went; goodbye goes to both (each engine waits for every front's before it stops)."""
    client, (zero, one) = two_engines
    big = inputs(client, 8)
    waits = [asyncio.create_task(client.encode(big))]
    assert await zero.frame() == [big]
    small, smaller = inputs(client, 1), inputs(client, 1)
    waits += [asyncio.create_task(client.encode(r)) for r in (small, smaller)]
    assert await one.frame() == [small, smaller]  # 0 and then 1 outstanding there, against 8

    waits[2].cancel()
    assert await one.frame() == [Abort([smaller.rid])]

    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(client.addresses.outputs[0])
    push.send(zero.codec.encoder.encode([EncodeOutput(big.rid, "float32", (8, 1), b"\0" * 32)]))
    assert (await asyncio.wait_for(waits[0], timeout=5)).rid == big.rid
    push.close(linger=0)
    after = inputs(client, 1)
    waits.append(asyncio.create_task(client.encode(after)))
    assert await zero.frame() == [after]  # engine 0 has nothing outstanding now, engine 1 one input

    await client.close()
    assert await zero.frame() == [Goodbye(0)]
    assert await one.frame() == [Goodbye(0)]
    for wait in waits[1:]:
        with contextlib.suppress(NotReady, asyncio.CancelledError):
            await wait


@pytest.mark.parametrize(
    ("states", "seen"),
    [
        ((EngineState.READY, None), None),  # not every engine process has spoken yet
        ((EngineState.READY, EngineState.WARMING), EngineState.WARMING),
        ((EngineState.READY, EngineState.READY), EngineState.READY),
        ((EngineState.FAILED, EngineState.LOADING), EngineState.FAILED),
        ((EngineState.READY, EngineState.FAILED), EngineState.FAILED),
        ((EngineState.STOPPED, EngineState.DRAINING), EngineState.DRAINING),
    ],
)
def test_the_front_sees_the_engine_processes_as_one_engine_ready_only_when_every_one_is(
    states: tuple[EngineState | None, ...], seen: EngineState | None
) -> None:
    statuses = [None if s is None else Status(s, pid=100 + k, engine=k) for k, s in enumerate(states)]
    status = combined(statuses)
    assert (status.state if status is not None else None) is seen


async def test_one_engine_process_that_drained_and_exited_does_not_fail_the_others_work(
    two_engines: tuple[EngineClient, list[EngineInput]],
) -> None:
    """Each engine process stops once it has answered everything; the front must not take the first one's
    exit for the engine's death while the other still owes answers. Real processes stand in for the
    engines (their pids are watched through pidfds as the engines' are)."""
    client, _ = two_engines
    stand_ins = [await asyncio.create_subprocess_exec("sleep", "60") for _ in range(2)]
    try:
        push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(client.addresses.outputs[0])
        codec = Codec.create()
        statuses = [
            Status(EngineState.STOPPED, stand_ins[0].pid, engine=0),
            Status(EngineState.DRAINING, stand_ins[1].pid, engine=1),
        ]
        push.send(codec.encoder.encode(statuses))
        await asyncio.wait_for(_until(lambda: client.state is EngineState.DRAINING), timeout=5)
        stand_ins[0].kill()
        await stand_ins[0].wait()
        await asyncio.wait_for(_until(lambda: stand_ins[0].pid not in client._pidfds), timeout=5)
        assert client.dead is None  # its exit was seen, and taken for what it was
        stand_ins[1].kill()
        await stand_ins[1].wait()
        await asyncio.wait_for(_until(lambda: client.dead is not None), timeout=5)
        assert f"the engine process {stand_ins[1].pid} exited" in str(client.dead)
        push.close(linger=0)
    finally:
        for process in stand_ins:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition` holds (the client's callbacks have no event to wait on)."""
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def test_a_starting_front_learns_the_engines_state_before_it_serves(
    two_engines: tuple[EngineClient, list[EngineInput]],
) -> None:
    """The kernel queues connections on a front's listening socket before the front runs; a front that
    starts beside running engines serves that queue as soon as its start returns. Its start waits for
    every engine process's status, so a pod already ready does not refuse them as loading (503). Without
    a status the wait ends at its bound (an engine still importing) and the front refuses as before."""
    client, _ = two_engines
    assert not await client.heard(0.2)  # nobody has spoken: unknown, after the bound
    assert client.status is None  # refused as loading meanwhile
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(client.addresses.outputs[0])
    codec = Codec.create()
    try:
        waiting = asyncio.create_task(client.heard(5.0))
        push.send(codec.encoder.encode([Status(EngineState.READY, os.getpid(), engine=0)]))
        await asyncio.wait_for(_until(lambda: client._statuses[0] is not None), timeout=5)
        await asyncio.sleep(0)
        assert not waiting.done()  # one engine process of two has spoken
        push.send(codec.encoder.encode([Status(EngineState.READY, os.getpid(), engine=1)]))
        assert await asyncio.wait_for(waiting, timeout=5)
        assert client.state is EngineState.READY
    finally:
        push.close(linger=0)


async def test_the_fronts_start_returns_once_the_engine_has_spoken(tmp_path: Path) -> None:
    addresses = Addresses.in_folder(str(tmp_path), 1)
    engine = EngineInput(addresses.input)
    service = Frontend(runtime_config(model={"name": "fake"}), EngineClient(addresses, 0))
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(addresses.outputs[0])
    try:
        starting = asyncio.create_task(service.start())
        await asyncio.wait_for(_until(lambda: service.client._pull is not None), timeout=5)
        assert not starting.done()  # bound, listening for the engine, not yet serving
        push.send(Codec.create().encoder.encode([Status(EngineState.READY, os.getpid(), engine=0)]))
        await asyncio.wait_for(starting, timeout=5)
        assert service.ready
    finally:
        push.close(linger=0)
        await service.client.close()
        engine.close()
