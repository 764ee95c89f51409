"""The engine side's ceiling: inputs per second the engine processes can take when the model costs
next to nothing, as on a GPU.

    python -m bench.host [--clients 64] [--seconds 15] [--workers 1] [--server-flag=FLAG ...]
                         [--label L] [--markdown out.md] [--json out.json]

On a GPU, MiniLM's forward pass takes a fraction of the host's work around it (collation, scheduling,
sockets, the Python of the loop), and each engine process does that work under one interpreter lock: on
an H100 (2026-11-27) the engine used 0.96 cores at about 0.15 ms of Python per input and served 7.1-7.5k
inputs/s whatever the GPU could do. This benchmark predicts that cap on a CPU: it serves a random encoder
of one layer 32 wide with MiniLM's tokenizer (`bench.gpu.models`' `tiny`: the forward pass costs next to
nothing) with `carpool serve` (`--model.instances 1 --model.torch-threads 1`, padded batches as on a GPU,
float32), loads it with closed-loop clients sending the benchmark corpus one text per request, and reads
every server thread's CPU time from /proc over the measured window.

The ceiling of one engine process is one core divided by its CPU seconds per input (all its threads
together: the loop, the socket threads, the model thread); the engine side's ceiling is the sum over the
engine processes (`model.processes`). The fronts' CPU per input and each front's cores are reported too
(how evenly the kernel spreads connections over them). The bar (issue 37): a ceiling of at least 30,000
inputs/s on this CPU's per-core speed. CPU per input barely moves with how busy the machine is, unlike
the inputs/s served here, which share the host's cores with the fronts and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python bench/host.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.mmap_dict import MmapedDict

from bench import loadgen
from bench.corpus import corpus
from bench.server import (
    HOST,
    ServerProcess,
    cpu_name,
    kernel_names,
    log,
    process_tree,
    role,
    scrape,
    thread_cores,
    thread_ticks,
)

CEILING_BAR = 30_000.0
"""Issue 37's bar: inputs/s the engine processes can take, from their CPU per input."""


# -- pure: from per-process cores to ceilings ------------------------------------------------------------


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    role: str
    """`engine`, `front` or `other` (`bench.server.role`)."""
    cores: float
    """Cores the process kept busy over the window (all its threads)."""
    inputs_per_s: float = 0.0
    """Inputs an engine process ran per second of the window (its own batch-size metric)."""


@dataclass(frozen=True)
class HostReport:
    label: str
    clients: int
    seconds: float
    inputs_per_s: float
    """Inputs the engines ran per second of the window (from the server's batch-size metric)."""
    requests_per_s: float
    mean_batch: float
    processes: list[ProcessCpu]

    def _of(self, kind: str) -> list[ProcessCpu]:
        return [p for p in self.processes if p.role == kind]

    def _inputs(self, process: ProcessCpu) -> float:
        """The inputs/s a process's CPU is divided by: an engine's own, a front's the whole server's."""
        return process.inputs_per_s if process.role == "engine" else self.inputs_per_s

    def us_per_input(self, process: ProcessCpu) -> float:
        inputs = self._inputs(process)
        return process.cores / inputs * 1e6 if inputs > 0 else float("nan")

    def ceiling(self, process: ProcessCpu) -> float:
        """Inputs/s this process could take with one core: one core over its CPU seconds per input."""
        return self._inputs(process) / process.cores if process.cores > 0 else float("inf")

    @property
    def engine_ceiling(self) -> float:
        """The engine side's ceiling: the sum of the engine processes' ceilings."""
        return sum(self.ceiling(p) for p in self._of("engine"))

    @property
    def front_cores(self) -> list[float]:
        return [p.cores for p in self._of("front")]

    def markdown(self) -> str:
        engines, fronts = self._of("engine"), self._of("front")
        engine_cores = sum(p.cores for p in engines)
        engine_us = engine_cores / self.inputs_per_s * 1e6 if self.inputs_per_s > 0 else float("nan")
        front_us = sum(self.us_per_input(p) for p in fronts)
        verdict = "meets" if self.engine_ceiling >= CEILING_BAR else "misses"
        lines = [
            f"**{self.label}**: {self.clients} clients, {self.seconds:.0f} s: "
            f"{self.inputs_per_s:,.0f} inputs/s served ({self.requests_per_s:,.0f} requests/s), "
            f"batches of {self.mean_batch:.1f} on average.",
            "",
            "| process | inputs/s | cores | CPU us per input | ceiling inputs/s |",
            "|---|---:|---:|---:|---:|",
        ]
        for p in engines:
            lines.append(
                f"| engine {p.pid} | {p.inputs_per_s:,.0f} | {p.cores:.3f} | {self.us_per_input(p):.1f} "
                f"| {self.ceiling(p):,.0f} |"
            )
        for p in fronts:
            lines.append(f"| front {p.pid} | | {p.cores:.3f} | {self.us_per_input(p):.1f} | |")
        lines += [
            "",
            f"Engine side: {engine_us:.1f} us of CPU per input served, over {len(engines)} process(es); "
            "ceiling "
            f"**{self.engine_ceiling:,.0f} inputs/s** ({verdict} the bar of {CEILING_BAR:,.0f}). Fronts: "
            f"{front_us:.1f} us per input; cores per front "
            + " / ".join(f"{c:.2f}" for c in sorted(self.front_cores, reverse=True))
            + ".",
        ]
        return "\n".join(lines)


# -- I/O: the tiny model, the server, /proc ----------------------------------------------------------------


def tiny_encoder(folder: Path) -> Path:
    """Build the random one-layer encoder with MiniLM's tokenizer under `folder`; its model folder."""
    from bench.gpu.models import build, prepare_encoder

    prepare_encoder(folder / "prepared")
    package = build(folder / "prepared", "tiny", folder / "built")
    return package / "model"


def serve_flags(model: Path, workers: int, extra: Sequence[str]) -> list[str]:
    return [
        "--model.source",
        str(model),
        "--model.dtype",
        "float32",
        "--model.packing",
        "padded",
        "--model.instances",
        "1",
        "--model.torch-threads",
        "1",
        "--server.workers",
        str(workers),
        *extra,
    ]


def process_inputs(pid: int) -> float:
    """Inputs process `pid` has run so far: the sum of its `carpool_batch_size` histogram in the server's
    multiprocess metric files (the folder is in its environment; a scrape of /metrics sums every process).
    0 where it has none."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return 0.0
    folder = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")), None)
    path = Path(folder.decode()) / f"histogram_{pid}.db" if folder else None
    if path is None or not path.exists():
        return 0.0
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):  # type: ignore[no-untyped-call]
        if json.loads(key)[1] == "carpool_batch_size_sum":
            total += value
    return total


@dataclass
class Window:
    result: loadgen.LoadResult
    before: dict[str, float]
    after: dict[str, float]
    used: dict[tuple[int, int], float]
    names: dict[tuple[int, int], str]
    inputs: dict[int, float]
    """Inputs each process ran over the window."""


async def _window(
    server: ServerProcess, payloads: list[loadgen.Payload], clients: int, seconds: float
) -> Window:
    pids = process_tree(server.pid)
    before_metrics = await scrape(server.port)
    before_inputs = {pid: process_inputs(pid) for pid in pids}
    before, started = thread_ticks(pids), time.monotonic()
    result = await loadgen.closed_loop(HOST, server.port, payloads, clients, seconds)
    after, wall = thread_ticks(pids), time.monotonic() - started
    inputs = {pid: process_inputs(pid) - before_inputs[pid] for pid in pids}
    after_metrics = await scrape(server.port)
    used = thread_cores(before, after, wall, os.sysconf("SC_CLK_TCK"))
    return Window(result, before_metrics, after_metrics, used, kernel_names(pids), inputs)


def measure(
    model: Path, clients: int, seconds: float, warmup_s: float, workers: int, extra: Sequence[str], label: str
) -> HostReport:
    server = ServerProcess(serve_flags(model, workers, extra))
    log(f"starting {' '.join(server.command)}")
    server.start()
    try:
        asyncio.run(server.wait_ready(600))
        payloads = loadgen.embedding_payloads(corpus(2048, 0), HOST, server.port)
        log(f"warm-up: {clients} clients for {warmup_s:.0f} s")
        loadgen.run(loadgen.closed_loop(HOST, server.port, payloads, clients, warmup_s))
        log(f"measuring: {clients} clients for {seconds:.0f} s")
        measured = asyncio.run(_window(server, payloads, clients, seconds))
    finally:
        server.stop()
    result, before, after, used, names = (
        measured.result,
        measured.before,
        measured.after,
        measured.used,
        measured.names,
    )
    window = result.window_s
    inputs = after.get("carpool_batch_size_sum", 0.0) - before.get("carpool_batch_size_sum", 0.0)
    batches = after.get("carpool_batch_size_count", 0.0) - before.get("carpool_batch_size_count", 0.0)
    per_process: dict[int, float] = {}
    for (pid, _), cores in used.items():
        per_process[pid] = per_process.get(pid, 0.0) + cores
    processes = [
        ProcessCpu(
            pid,
            "supervisor" if pid == server.pid else role(pid, names),
            cores,
            measured.inputs.get(pid, 0.0) / window if window > 0 else 0.0,
        )
        for pid, cores in sorted(per_process.items())
    ]
    return HostReport(
        label=label,
        clients=clients,
        seconds=window,
        inputs_per_s=inputs / window if window > 0 else 0.0,
        requests_per_s=result.requests_per_s,
        mean_batch=inputs / batches if batches else float("nan"),
        processes=processes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="the measured window (default 15)")
    parser.add_argument("--warmup", type=float, default=4.0, help="load before the window (default 4)")
    parser.add_argument("--workers", type=int, default=1, help="front processes (default 1)")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG")
    parser.add_argument("--label", default="carpool", help="names the report (for example the commit)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="carpool-host-") as tmp:
        model = tiny_encoder(Path(tmp))
        report = measure(
            model, args.clients, args.seconds, args.warmup, args.workers, args.server_flag, args.label
        )
    text = f"{report.markdown()}\n\nCPU: {cpu_name()}, {os.cpu_count()} cores."
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
