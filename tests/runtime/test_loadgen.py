"""The benchmark's load generator against a real HTTP server on loopback (asyncio, in the test).

The server answers each request with the status code the request's body asks for, so that the counts
the load generator reports can be checked exactly, and it can hold answers back to check how many
requests a closed loop keeps in flight.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable

import pytest
from bench import loadgen
from bench.loadgen import Payload, closed_loop, encode_request, http_get, open_loop, percentile

HOST = "127.0.0.1"
REASONS = {200: "OK", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


class FakeServer:
    """HTTP/1.1 keep-alive server; `hold(server)` may return a future to await before answering."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.active = 0
        self.active_at_arrival: list[int] = []
        self.hold: Callable[[FakeServer], asyncio.Future[None] | None] = lambda server: None
        self.chunked = False
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeServer:
        self._server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                status = json.loads(body).get("status", 200) if body else 200
                self.arrivals += 1
                self.active += 1
                self.active_at_arrival.append(self.active)
                waiter = self.hold(self)
                if waiter is not None:
                    await waiter
                else:
                    self.active -= 1
                payload = json.dumps({"status": status, "n": self.arrivals}).encode()
                if self.chunked:
                    chunks = b"".join(
                        b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:5], payload[5:])
                    )
                    writer.write(
                        f"HTTP/1.1 {status} {REASONS[status]}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                        + chunks
                        + b"0\r\n\r\n"
                    )
                else:
                    writer.write(
                        f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(payload)}\r\n\r\n".encode()
                        + payload
                    )
                await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    async with FakeServer() as running:
        yield running


def payloads(port: int, statuses: list[int]) -> list[Payload]:
    return [
        Payload(encode_request(HOST, port, "POST", "/v1/embeddings", json.dumps({"status": s}).encode()), 2)
        for s in statuses
    ]


async def test_closed_loop_counts_statuses_and_inputs(server: FakeServer) -> None:
    mix = [200, 200, 429, 503, 500]
    result = await closed_loop(HOST, server.port, payloads(server.port, mix), clients=3, requests=50)

    assert server.arrivals == 50
    assert result.sent == 50
    assert result.status_summary() == {"200": 20, "429": 10, "503": 10, "other": 10, "error": 0}
    assert len(result.latencies) == 50
    assert len(result.ok_latencies) == 20
    assert result.ok_in_window == 20
    assert result.ok_inputs_in_window == 40
    assert all(latency > 0 for latency in result.latencies)
    assert result.window_s > 0
    assert result.inputs_per_s == pytest.approx(2 * result.requests_per_s)


async def test_closed_loop_keeps_exactly_n_in_flight(server: FakeServer) -> None:
    """The server answers only while N requests are held (one at a time, oldest first), so a client
    that sent fewer than N would stall and one that sent more would show N + 1 at some arrival."""
    clients, total = 4, 40
    waiting: deque[asyncio.Future[None]] = deque()

    def hold(srv: FakeServer) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        waiting.append(waiter)
        if srv.arrivals == total:  # the last one: nothing more will come, let everything go
            while waiting:
                srv.active -= 1
                waiting.popleft().set_result(None)
        elif srv.active == clients:
            srv.active -= 1
            waiting.popleft().set_result(None)
        return waiter

    server.hold = hold
    result = await asyncio.wait_for(
        closed_loop(HOST, server.port, payloads(server.port, [200]), clients=clients, requests=total), 2.0
    )

    assert result.statuses[200] == total
    assert result.max_inflight == clients
    assert server.active_at_arrival[:clients] == [1, 2, 3, 4]
    assert server.active_at_arrival[clients:] == [clients] * (total - clients)
    assert result.connections == clients


async def test_closed_loop_latency_spans_the_answer(server: FakeServer) -> None:
    """Latency runs from sending to the whole answer: here the server answers 50 ms after arrival."""
    loop = asyncio.get_running_loop()

    def hold(srv: FakeServer) -> asyncio.Future[None]:
        waiter = loop.create_future()

        def answer() -> None:
            srv.active -= 1
            waiter.set_result(None)

        loop.call_later(0.05, answer)
        return waiter

    server.hold = hold
    server.chunked = True
    result = await closed_loop(HOST, server.port, payloads(server.port, [200]), clients=1, requests=4)

    assert result.statuses[200] == 4
    assert all(0.05 <= latency < 0.5 for latency in result.ok_latencies)
    assert result.p50 >= 0.05


async def test_open_loop_counts_and_bounds_connections(server: FakeServer) -> None:
    mix = [200, 429, 503, 500]
    result = await open_loop(
        HOST, server.port, payloads(server.port, mix), rate=2000.0, requests=80, max_connections=3, seed=1
    )

    assert server.arrivals == 80
    assert result.status_summary() == {"200": 20, "429": 20, "503": 20, "other": 20, "error": 0}
    assert result.connections <= 3
    assert result.max_inflight <= 80
    assert len(result.latencies) == 80
    assert result.ok_inputs_in_window == 40


async def test_errors_are_counted_not_raised() -> None:
    """A server that closes the connection without answering: every request is an error."""

    async def slam(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(slam, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        result = await closed_loop(HOST, port, payloads(port, [200]), clients=2, requests=6)
    finally:
        server.close()
        await server.wait_closed()
    assert result.sent == 6
    assert result.errors == 6
    assert result.status_summary()["200"] == 0


async def test_http_get(server: FakeServer) -> None:
    status, body = await http_get(HOST, server.port, "/metrics")
    assert status == 200
    assert json.loads(body)["status"] == 200


def test_bounds_are_required() -> None:
    with pytest.raises(ValueError, match="bounded"):
        loadgen.run(closed_loop(HOST, 1, payloads(1, [200]), clients=1))


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([5.0], 99) == 5.0
