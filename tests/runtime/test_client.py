"""The front's door to the engine (`api.client.EngineClient`) over real ZeroMQ sockets, with a bare PULL
socket standing in for the engine's input (the full engine is behind every other runtime test): the
requests of one event-loop turn travel in one frame, in the order they were made, an abort never overtakes
its request, and a frame that cannot be sent fails its requests instead of leaving them waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from carpool.runtime.api.client import EngineClient
from carpool.runtime.errors import NotReady
from carpool.runtime.wire import Abort, Addresses, Codec, EncodeOutput, EncodeRequest, FrontMessage, Goodbye


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
    assert client._push is not None
    client._push.close(linger=0)  # the socket goes away under the front (what a torn-down context does)
    with pytest.raises(NotReady, match="could not reach the model engine"):
        await asyncio.wait_for(client.encode(request(client, 1)), timeout=5)
