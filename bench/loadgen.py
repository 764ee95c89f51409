"""A cheap HTTP/1.1 load generator: closed loop (N clients) and open loop (Poisson arrivals).

The benchmark machine has two cores and shares them with the server, so every microsecond the client
spends per request is taken from the server. Hence raw asyncio streams instead of an HTTP library:
requests are encoded once up front, connections are kept alive, and a response is parsed only as far
as its status line, its headers and a Content-Length (or chunked) body, which is read and dropped.

- Closed loop: `clients` connections, each with exactly one request in flight; a client sends its next
  request as soon as the previous answer arrives. Measures capacity (saturation throughput).
- Open loop: requests arrive at Poisson times at `rate` per second whatever the server does, on a pool of
  keep-alive connections that grows as needed up to `max_connections`. Latency is measured from the
  scheduled arrival, so a client that falls behind (no free connection, a late timer) shows up as
  latency instead of silently lowering the load (no coordinated omission).

Both stop after `duration_s` or `requests`, whichever comes first, then wait (bounded) for the requests
in flight. Run as a script: `python -m bench.loadgen --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

Clock = Callable[[], float]
T = TypeVar("T")


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as this client understands it."""


@dataclass(frozen=True)
class Payload:
    """One whole pre-encoded HTTP request and how many model inputs it carries."""

    data: bytes
    inputs: int = 1


def encode_request(
    host: str, port: int, method: str, path: str, body: bytes = b"", content_type: str = "application/json"
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if body or method in ("POST", "PUT"):
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + body


def embedding_payloads(
    texts: Sequence[str], host: str, port: int, path: str = "/v1/embeddings", per_request: int = 1
) -> list[Payload]:
    """OpenAI embedding requests (`{"input": text}` or a list of `per_request` texts), in corpus order."""
    payloads = []
    for start in range(0, len(texts), per_request):
        chunk = list(texts[start : start + per_request])
        body = json.dumps({"input": chunk[0] if per_request == 1 else chunk}).encode()
        payloads.append(Payload(encode_request(host, port, "POST", path, body), len(chunk)))
    return payloads


class Connection:
    """One keep-alive HTTP/1.1 connection; one exchange at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.closed = False
        self.retry_after: bytes | None = None
        """The Retry-After header of the last answer, if it had one."""

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send a pre-encoded request; return (status, body)."""
        if self.closed:
            raise ProtocolError("connection already closed")
        writer = self._writer
        writer.write(request)
        if writer.transport.get_write_buffer_size() > 1 << 16:
            await writer.drain()
        head = await self._reader.readuntil(b"\r\n\r\n")
        line_end = head.find(b"\r\n")
        version, _, rest = head[:line_end].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {head[:line_end]!r}")
        try:
            status = int(rest[:3])
        except ValueError:
            raise ProtocolError(f"bad status line {head[:line_end]!r}") from None
        length = -1
        chunked = False
        close = version == b"HTTP/1.0"
        self.retry_after = None
        for line in head[line_end + 2 : -4].split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
            elif name == b"retry-after":
                self.retry_after = value.strip()
        if chunked:
            body = await self._read_chunked()
        elif length >= 0:
            body = await self._reader.readexactly(length)
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:
            body = await self._reader.read()  # no length: the body runs to the end of the connection
            close = True
        if close:
            self.close()
        return status, body

    async def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_line = await self._reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await self._reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return b"".join(parts)
            parts.append(await self._reader.readexactly(size))
            await self._reader.readexactly(2)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()


async def http_get(host: str, port: int, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One GET on a fresh connection (readiness checks, /metrics scrapes)."""
    conn = await asyncio.wait_for(Connection.open(host, port), timeout_s)
    try:
        return await asyncio.wait_for(conn.exchange(encode_request(host, port, "GET", path)), timeout_s)
    finally:
        conn.close()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LoadResult:
    """What one load run saw. Latencies are in seconds; `ok` means status 200."""

    mode: str
    """"closed" or "open"."""
    window_s: float
    """The measurement window: throughput is what completed in it, divided by it."""
    clients: int | None = None
    rate: float | None = None
    """Offered arrival rate (open loop), requests/s."""
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    refused_without_retry_after: int = 0
    """429 and 503 answers that did not say when to retry (a `Retry-After` of at least 1 s)."""
    errors: int = 0
    """Requests without an HTTP answer (connection failures, protocol errors, unfinished at the end)."""
    latencies: list[float] = field(default_factory=list)
    """Every answered request's latency, any status, in completion order."""
    ok_latencies: list[float] = field(default_factory=list)
    ok_in_window: int = 0
    ok_inputs_in_window: int = 0
    max_inflight: int = 0
    connections: int = 0
    """Connections opened (open loop: the pool's size at its largest; reconnects count too)."""

    @property
    def requests_per_s(self) -> float:
        return self.ok_in_window / self.window_s if self.window_s > 0 else 0.0

    @property
    def inputs_per_s(self) -> float:
        return self.ok_inputs_in_window / self.window_s if self.window_s > 0 else 0.0

    def latency(self, q: float) -> float:
        """Percentile `q` of successful requests' latency, seconds."""
        return percentile(self.ok_latencies, q)

    @property
    def p50(self) -> float:
        return self.latency(50)

    @property
    def p90(self) -> float:
        return self.latency(90)

    @property
    def p95(self) -> float:
        return self.latency(95)

    @property
    def p99(self) -> float:
        return self.latency(99)

    def status_summary(self) -> dict[str, int]:
        known = {code: self.statuses[code] for code in (200, 429, 503)}
        other = sum(count for code, count in self.statuses.items() if code not in known)
        return {"200": known[200], "429": known[429], "503": known[503], "other": other, "error": self.errors}

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "clients": self.clients,
            "rate": self.rate,
            "window_s": self.window_s,
            "sent": self.sent,
            "statuses": self.status_summary(),
            "requests_per_s": self.requests_per_s,
            "inputs_per_s": self.inputs_per_s,
            "p50_ms": self.p50 * 1e3,
            "p90_ms": self.p90 * 1e3,
            "p95_ms": self.p95 * 1e3,
            "p99_ms": self.p99 * 1e3,
            "max_inflight": self.max_inflight,
            "connections": self.connections,
        }


class _Recorder:
    def __init__(self, result: LoadResult, window_end: float | None) -> None:
        self.result = result
        self.window_end = window_end
        self.inflight = 0
        self.last_end = 0.0

    def started(self) -> None:
        self.result.sent += 1
        self.inflight += 1
        self.result.max_inflight = max(self.result.max_inflight, self.inflight)

    def finished(
        self, start: float, end: float, status: int | None, inputs: int, retry_after: bytes | None = None
    ) -> None:
        self.inflight -= 1
        result = self.result
        if status is None:
            result.errors += 1
            return
        if status in (429, 503) and not (retry_after and retry_after.isdigit() and int(retry_after) >= 1):
            result.refused_without_retry_after += 1
        latency = end - start
        result.statuses[status] += 1
        result.latencies.append(latency)
        if status == 200:
            result.ok_latencies.append(latency)
            if self.window_end is None or end <= self.window_end:
                result.ok_in_window += 1
                result.ok_inputs_in_window += inputs
        self.last_end = max(self.last_end, end)


def _check_bounds(duration_s: float | None, requests: int | None) -> None:
    if duration_s is None and requests is None:
        raise ValueError("give duration_s or requests (or both): a load run must be bounded")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    if requests is not None and requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")


Exchange = Callable[[int, int], Awaitable[tuple[int | None, int, bytes | None]]]
"""One request of a closed loop: (client slot, payload index) -> (status, or None without an answer; the
inputs it carried; its Retry-After)."""


async def drive_closed_loop(
    exchange: Exchange,
    payloads: int,
    clients: int,
    result: LoadResult,
    duration_s: float | None,
    requests: int | None,
    drain_timeout_s: float,
    clock: Clock,
) -> LoadResult:
    """The loop of `closed_loop` over any transport: `clients` tasks, each sending its next request when
    its last is answered, payload indexes taken in order (cycling) over `payloads`; fills `result`."""
    start = clock()
    deadline = None if duration_s is None else start + duration_s
    recorder = _Recorder(result, deadline)
    issued = 0

    async def client(slot: int) -> None:
        nonlocal issued
        while (requests is None or issued < requests) and (deadline is None or clock() < deadline):
            index = issued % payloads
            issued += 1
            recorder.started()
            began = clock()
            status, inputs, retry_after = await exchange(slot, index)
            recorder.finished(began, clock(), status, inputs, retry_after)

    tasks = [asyncio.create_task(client(slot)) for slot in range(clients)]
    await _wait_bounded(tasks, None if duration_s is None else duration_s + drain_timeout_s, recorder)
    result.window_s = duration_s if duration_s is not None else max(0.0, recorder.last_end - start)
    return result


async def closed_loop(
    host: str,
    port: int,
    payloads: Sequence[Payload],
    clients: int,
    duration_s: float | None = None,
    requests: int | None = None,
    drain_timeout_s: float = 30.0,
    clock: Clock = time.perf_counter,
) -> LoadResult:
    """`clients` connections, one request in flight on each, payloads taken in order (cycling).

    With `duration_s`, throughput counts what completed within it; requests still in flight at the end
    are awaited (up to `drain_timeout_s`) and their latencies recorded. With only `requests`, exactly that
    many are sent and the window ends at the last answer."""
    _check_bounds(duration_s, requests)
    if clients < 1 or not payloads:
        raise ValueError("need at least one client and one payload")
    conns = list(await asyncio.gather(*(Connection.open(host, port) for _ in range(clients))))
    result = LoadResult(mode="closed", window_s=0.0, clients=clients, connections=clients)

    async def exchange(slot: int, index: int) -> tuple[int | None, int, bytes | None]:
        payload = payloads[index]
        conn = conns[slot]
        if conn.closed:
            conn = conns[slot] = await Connection.open(host, port)
            result.connections += 1
        status: int | None
        try:
            status, _ = await conn.exchange(payload.data)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProtocolError):
            status = None
            conn.close()
        return status, payload.inputs, conn.retry_after

    try:
        return await drive_closed_loop(
            exchange, len(payloads), clients, result, duration_s, requests, drain_timeout_s, clock
        )
    finally:
        for conn in conns:
            conn.close()


class _Pool:
    """Keep-alive connections for the open loop: reuse an idle one, else open one, up to `limit`."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[Connection] = []
        self.opened = 0
        self.largest = 0
        self.all: list[Connection] = []
        self._slots = asyncio.Semaphore(limit)

    async def acquire(self) -> Connection:
        await self._slots.acquire()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        try:
            conn = await Connection.open(self.host, self.port)
        except BaseException:
            self._slots.release()
            raise
        self.opened += 1
        self.all.append(conn)
        self.largest = max(self.largest, sum(1 for c in self.all if not c.closed))
        return conn

    def release(self, conn: Connection) -> None:
        if not conn.closed:
            self.idle.append(conn)
        self._slots.release()

    def close(self) -> None:
        for conn in self.all:
            conn.close()


async def open_loop(
    host: str,
    port: int,
    payloads: Sequence[Payload],
    rate: float,
    duration_s: float | None = None,
    requests: int | None = None,
    max_connections: int = 256,
    seed: int = 0,
    drain_timeout_s: float = 30.0,
    clock: Clock = time.perf_counter,
) -> LoadResult:
    """Poisson arrivals at `rate` requests/s until `duration_s` or `requests`; latency from the scheduled
    arrival time. The window is `duration_s` (or the span of arrivals when bounded by count only)."""
    _check_bounds(duration_s, requests)
    if rate <= 0 or not payloads:
        raise ValueError("need a positive rate and at least one payload")
    rng = random.Random(seed)
    pool = _Pool(host, port, max_connections)
    result = LoadResult(mode="open", window_s=0.0, rate=rate)
    # Open-loop throughput is the rate of answers, including those that finish after the last arrival.
    recorder = _Recorder(result, None)
    tasks: set[asyncio.Task[None]] = set()

    async def one(payload: Payload, scheduled: float) -> None:
        recorder.started()
        status: int | None = None
        try:
            conn = await pool.acquire()
        except OSError:
            recorder.finished(scheduled, clock(), None, payload.inputs)
            return
        try:
            status, _ = await conn.exchange(payload.data)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProtocolError):
            conn.close()
        finally:
            pool.release(conn)
        recorder.finished(scheduled, clock(), status, payload.inputs, conn.retry_after)

    start = clock()
    arrival = start
    count = 0
    try:
        while requests is None or count < requests:
            arrival += rng.expovariate(rate)
            if duration_s is not None and arrival >= start + duration_s:
                break
            delay = arrival - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(payloads[count % len(payloads)], arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            count += 1
        last_arrival = arrival
        await _wait_bounded(list(tasks), drain_timeout_s, recorder)
    finally:
        pool.close()
    result.connections = pool.opened
    result.window_s = duration_s if duration_s is not None else max(0.0, last_arrival - start)
    return result


async def _wait_bounded(
    tasks: list[asyncio.Task[None]], timeout_s: float | None, recorder: _Recorder
) -> None:
    """Wait for `tasks`; after `timeout_s`, cancel the rest and count their requests as errors."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
        recorder.result.errors += recorder.inflight
        recorder.inflight = 0
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error  # a bug in the client, not an answer from the server


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a load coroutine on uvloop when installed (cheaper per request), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _parse_url(url: str) -> tuple[str, int, str]:
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    return host, int(port or 80), "/" + path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8011/v1/embeddings")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--clients", type=int, help="closed loop with this many clients")
    mode.add_argument("--rate", type=float, help="open loop, Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--requests", type=int, help="stop after this many requests")
    parser.add_argument("--per-request", type=int, default=1, help="texts per request")
    parser.add_argument("--corpus-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    host, port, path = _parse_url(args.url)
    if host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("this benchmark only targets loopback addresses")
    from bench.corpus import corpus

    payloads = embedding_payloads(corpus(args.corpus_size, args.seed), host, port, path, args.per_request)
    if args.clients is not None:
        result = run(closed_loop(host, port, payloads, args.clients, args.duration, args.requests))
    else:
        result = run(open_loop(host, port, payloads, args.rate, args.duration, args.requests, seed=args.seed))
    json.dump(result.summary(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    if not __package__:  # `python bench/loadgen.py`: make `bench` importable
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
