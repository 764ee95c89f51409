"""The engine side's ceiling: inputs per second the engine processes can take when the model costs
little, as on a GPU.

    python -m bench.host [--processes 1] [--clients 64] [--workers 1] [--seconds 15] [--server-flag=FLAG ...]
    python -m bench.host --engines-only [--processes 4] [--clients 96] [--seconds 15]

On a GPU, MiniLM's forward pass takes a fraction of the host's work around it (collation, scheduling,
sockets, the Python of the loop), and each engine process does that work under one interpreter lock: on
an H100 (2026-11-27) the engine used 0.96 cores at about 0.15 ms per input and served 7.1-7.5k inputs/s
whatever the GPU could do. This benchmark predicts that cap on a CPU: it serves a random encoder of one
layer 32 wide with MiniLM's tokenizer (`bench.gpu.models`' `tiny`) with `--model.instances 1
--model.torch-threads 1`, padded batches as on a GPU, float32, `model.processes` engine processes, and
reads every server thread's CPU time from /proc over the measured window.

Two ways to load it:
- by default, `carpool serve` (`--workers` fronts) under `--clients` closed-loop HTTP clients, each
  request one text of the benchmark corpus (issue 37's measurement). On a small host the fronts take
  most of the CPU, the engines wait for work and their batches stay small;
- `--engines-only`: the engine processes alone, started as `carpool serve` starts them, with this
  process as their one front, speaking the wire with pre-tokenized requests and keeping `--clients`
  requests in flight on each engine process: the engines run at saturation, in full batches.

The ceiling of one engine process is one core divided by its CPU seconds per input (all its threads
together: the loop, the socket threads, the model thread); the engine side's ceiling is the sum over the
engine processes. Each engine's inputs and batches come from its own metric files, its CPU per thread
name (`carpool.runtime.threads`) from /proc: the model thread (`carpool-engine`) holds the stand-in's
own compute, which on a GPU runs on the device. The fronts' CPU per input and each front's cores are
reported too (how evenly the kernel spreads connections over them). The bar (issue 37): a ceiling of at
least 30,000 inputs/s on this CPU's per-core speed. CPU per input barely moves with how busy the machine
is, unlike the inputs/s served here, which share the host's cores with everything else.
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
from dataclasses import asdict, dataclass, field
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
from carpool.runtime.threads import is_model_thread
from carpool.runtime.wire import Addresses

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
    batches_per_s: float = 0.0
    """Batches an engine process ran per second of the window."""
    threads: dict[str, float] = field(default_factory=dict)
    """Cores by thread kernel name (`carpool.runtime.threads`; ZeroMQ's `ZMQbg/...`)."""


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

    engines_only: bool = False
    """Loaded through the wire (`--engines-only`): `clients` is requests in flight per engine process."""

    @property
    def load(self) -> str:
        if self.engines_only:
            return f"engines only, {self.clients} requests in flight per engine process"
        return f"{self.clients} HTTP clients"

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
    def host_us_per_input(self) -> float:
        """Host CPU per input served, the model's threads excluded (issue 46's measure): every thread of
        every process of the server (fronts, the engines' loop and socket threads, ZeroMQ's, the
        supervisor) but the model threads (`carpool.runtime.threads.is_model_thread`: the forward
        pass and its collation), over the inputs the engines ran."""
        if self.inputs_per_s <= 0:
            return float("nan")
        host = sum(
            cores
            for process in self.processes
            for name, cores in process.threads.items()
            if not (process.role == "engine" and is_model_thread(name))
        )
        return host / self.inputs_per_s * 1e6

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
            f"**{self.label}**: {self.load}, {self.seconds:.0f} s: "
            f"{self.inputs_per_s:,.0f} inputs/s served ({self.requests_per_s:,.0f} requests/s), "
            f"batches of {self.mean_batch:.1f} on average.",
            "",
            "| process | inputs/s | inputs per batch | cores | CPU us per input | ceiling inputs/s | "
            "us per input by thread |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for p in engines:
            batch = p.inputs_per_s / p.batches_per_s if p.batches_per_s else float("nan")
            inputs = self._inputs(p)
            by_thread = ", ".join(
                f"{name} {cores / inputs * 1e6:.0f}"
                for name, cores in sorted(p.threads.items(), key=lambda item: -item[1])
                if inputs > 0 and cores / inputs * 1e6 >= 1.0
            )
            lines.append(
                f"| engine {p.pid} | {p.inputs_per_s:,.0f} | {batch:.1f} | {p.cores:.3f} | "
                f"{self.us_per_input(p):.1f} | {self.ceiling(p):,.0f} | {by_thread} |"
            )
        for p in fronts:
            lines.append(f"| front {p.pid} | | | {p.cores:.3f} | {self.us_per_input(p):.1f} | | |")
        lines += [
            "",
            f"Engine side: {engine_us:.1f} us of CPU per input served, over {len(engines)} process(es); "
            "ceiling "
            f"**{self.engine_ceiling:,.0f} inputs/s** ({verdict} the bar of {CEILING_BAR:,.0f}). Fronts: "
            f"{front_us:.1f} us per input; host CPU outside the model's threads (fronts, engines, "
            f"supervisor) {self.host_us_per_input:.1f} us per input; cores per front "
            + (" / ".join(f"{c:.2f}" for c in sorted(self.front_cores, reverse=True)) or "none")
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


def process_batches(pid: int) -> tuple[float, float]:
    """(inputs, batches) process `pid` has run so far: its `carpool_batch_size` histogram's sum and count
    in the server's multiprocess metric files (the folder is in its environment; a scrape of /metrics sums
    every process). Zeros where it has none."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return 0.0, 0.0
    folder = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")), None)
    path = Path(folder.decode()) / f"histogram_{pid}.db" if folder else None
    if path is None or not path.exists():
        return 0.0, 0.0
    inputs = batches = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):  # type: ignore[no-untyped-call]
        name = json.loads(key)[1]
        if name == "carpool_batch_size_sum":
            inputs += value
        elif name == "carpool_batch_size_bucket":  # stored per bucket, not cumulative: they add up
            batches += value
    return inputs, batches


def process_inputs(pid: int) -> float:
    """Inputs process `pid` has run so far (`process_batches`)."""
    return process_batches(pid)[0]


def _processes(
    pids: Sequence[int],
    roles: dict[int, str],
    used: dict[tuple[int, int], float],
    names: dict[tuple[int, int], str],
    before: dict[int, tuple[float, float]],
    after: dict[int, tuple[float, float]],
    seconds: float,
) -> list[ProcessCpu]:
    """Each process's cores (in all and by thread name), and for engines their inputs and batches per
    second, over a window of `seconds`."""
    found = []
    for pid in pids:
        threads: dict[str, float] = {}
        for (owner, tid), cores in used.items():
            if owner == pid:
                name = names.get((owner, tid), "?")
                threads[name] = threads.get(name, 0.0) + cores
        start, end = before.get(pid, (0.0, 0.0)), after.get(pid, (0.0, 0.0))
        per_s = 1.0 / seconds if seconds > 0 else 0.0
        found.append(
            ProcessCpu(
                pid,
                roles[pid],
                sum(threads.values()),
                (end[0] - start[0]) * per_s,
                (end[1] - start[1]) * per_s,
                threads,
            )
        )
    return found


@dataclass
class Window:
    result: loadgen.LoadResult
    before: dict[str, float]
    after: dict[str, float]
    used: dict[tuple[int, int], float]
    names: dict[tuple[int, int], str]
    batches_before: dict[int, tuple[float, float]]
    batches_after: dict[int, tuple[float, float]]
    """(inputs, batches) each process had run at the window's start and end."""


async def _window(
    server: ServerProcess, payloads: list[loadgen.Payload], clients: int, seconds: float
) -> Window:
    pids = process_tree(server.pid)
    before_metrics = await scrape(server.port)
    batches_before = {pid: process_batches(pid) for pid in pids}
    before, started = thread_ticks(pids), time.monotonic()
    result = await loadgen.closed_loop(HOST, server.port, payloads, clients, seconds)
    after, wall = thread_ticks(pids), time.monotonic() - started
    batches_after = {pid: process_batches(pid) for pid in pids}
    after_metrics = await scrape(server.port)
    used = thread_cores(before, after, wall, os.sysconf("SC_CLK_TCK"))
    names = kernel_names(pids)
    return Window(result, before_metrics, after_metrics, used, names, batches_before, batches_after)


def measure(
    model: Path,
    clients: int,
    seconds: float,
    warmup_s: float,
    workers: int,
    extra: Sequence[str],
    label: str,
    source: Path | None = None,
) -> HostReport:
    """`carpool serve` under closed-loop HTTP clients; `source`: another checkout whose runtime it runs
    (`bench.server.ServerProcess`), for a before/after in one run."""
    server = ServerProcess(serve_flags(model, workers, extra), source=source)
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
    pids = sorted({pid for pid, _ in used})
    roles = {pid: "supervisor" if pid == server.pid else role(pid, names) for pid in pids}
    processes = _processes(pids, roles, used, names, measured.batches_before, measured.batches_after, window)
    return HostReport(
        label=label,
        clients=clients,
        seconds=window,
        inputs_per_s=inputs / window if window > 0 else 0.0,
        requests_per_s=result.requests_per_s,
        mean_batch=inputs / batches if batches else float("nan"),
        processes=processes,
    )


# -- the engines alone: this process as their front -------------------------------------------------------


def _engine_config(model: Path, processes: int, extra: Sequence[str]) -> dict[str, object]:
    """The engine processes' runtime config: the server's (`serve_flags`) as `carpool serve` reads it."""
    model_section: dict[str, object] = {
        "source": str(model),
        "dtype": "float32",
        "packing": "padded",
        "instances": 1,
        "torch_threads": 1,
    }
    if processes > 1:
        model_section["processes"] = processes
    config: dict[str, object] = {"model": model_section}
    for flag in extra:
        key, _, value = flag.removeprefix("--").partition("=")
        section, _, name = key.replace("-", "_").partition(".")
        config.setdefault(section, {})[name] = value  # type: ignore[index]
    return config


def _drive_engines(
    addresses: Addresses, ids: list[list[int]], depth: int, warmup_s: float, seconds: float, pids: list[int]
) -> tuple[float, list[ProcessCpu], float]:
    """Keep `depth` requests in flight on each engine process, speaking the wire as a front does (a frame
    of requests per engine per turn) but with nothing else to do, so that a small host still saturates
    the engines: the measured window's seconds, the engine processes' use, and requests per second."""
    import zmq

    from carpool.runtime.wire import Codec, EncodeOutput, EncodeRequest, EngineState, Goodbye, Status

    engines = getattr(addresses, "engines", 1)  # (the runtime before issue 37 ran one engine process)
    codec = Codec.create()
    context = zmq.Context()
    pushes = []
    for engine in range(engines):
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(addresses.engine_input(engine) if engine else addresses.input)
        pushes.append(push)
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(addresses.outputs[0])
    try:
        ready: set[int] = set()
        while len(ready) < engines:
            for message in codec.engine_decoder.decode(pull.recv()):
                if isinstance(message, Status):
                    if message.state is EngineState.FAILED:
                        raise RuntimeError(f"an engine process failed: {message.failure}")
                    if message.state is EngineState.READY:
                        ready.add(getattr(message, "engine", 0))
        sequence = 0

        def requests(engine: int, count: int) -> bytes:
            nonlocal sequence
            now = time.monotonic()
            batch = []
            for _ in range(count):
                sequence += 1
                rid = sequence * engines + engine  # the engine a request went to is its rid modulo engines
                batch.append(EncodeRequest(rid, 0, [ids[sequence % len(ids)]], 0, now, now + 60.0))
            return codec.encoder.encode(batch)

        def run(until: float) -> int:
            answered = 0
            for engine in range(engines):
                pushes[engine].send(requests(engine, depth))
            outstanding = depth * engines
            while outstanding:
                more = [0] * engines
                for message in codec.engine_decoder.decode(pull.recv()):
                    if isinstance(message, EncodeOutput):
                        more[message.rid % engines] += 1
                    elif not isinstance(message, Status):
                        raise RuntimeError(f"the engine answered {message}")
                answered += sum(more)
                outstanding -= sum(more)
                if time.monotonic() < until:
                    for engine, count in enumerate(more):
                        if count:
                            pushes[engine].send(requests(engine, count))
                            outstanding += count
            return answered

        run(time.monotonic() + warmup_s)
        batches_before = {pid: process_batches(pid) for pid in pids}
        before, started = thread_ticks(pids), time.monotonic()
        answered = run(started + seconds)
        after, wall = thread_ticks(pids), time.monotonic() - started
        batches_after = {pid: process_batches(pid) for pid in pids}
        used = thread_cores(before, after, wall, os.sysconf("SC_CLK_TCK"))
        names = kernel_names(pids)
        for push in pushes:
            push.send(codec.encoder.encode([Goodbye(0)]))
        roles = dict.fromkeys(pids, "engine")
        processes = _processes(pids, roles, used, names, batches_before, batches_after, wall)
        return wall, processes, answered / wall
    finally:
        for sock in [*pushes, pull]:
            sock.close(linger=1000)
        context.term()


def measure_engines(
    model: Path,
    processes: int,
    clients: int,
    seconds: float,
    warmup_s: float,
    extra: Sequence[str],
    label: str,
) -> HostReport:
    """The engine processes alone, started as `carpool serve` starts them, with this process as their one
    front sending pre-tokenized requests: nothing else shares the host's cores, so the engines run at
    saturation and their CPU per input is that of full batches."""
    import multiprocessing

    from tokenizers import Tokenizer

    from carpool.runtime.engine.process import main as engine_main

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = [encoding.ids for encoding in tokenizer.encode_batch(corpus(2048, 0))]
    config = _engine_config(model, processes, extra)
    with tempfile.TemporaryDirectory(prefix="carpool-engines-") as folder:
        metrics = Path(folder) / "metrics"
        metrics.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
        addresses = (
            Addresses.in_folder(folder, 1, processes) if processes > 1 else Addresses.in_folder(folder, 1)
        )
        spawn = multiprocessing.get_context("spawn")
        engines = [
            spawn.Process(target=engine_main, args=(config, addresses, None, *([k] if k else [])))
            for k in range(processes)
        ]
        for engine in engines:
            engine.start()
        try:
            pids = [engine.pid for engine in engines if engine.pid is not None]
            log(
                f"engine processes {pids}: {clients} requests in flight, {warmup_s:.0f} s warm-up, "
                f"{seconds:.0f} s measured"
            )
            wall, use, requests_per_s = _drive_engines(addresses, ids, clients, warmup_s, seconds, pids)
        finally:
            for engine in engines:
                engine.terminate()  # drain: each stops once this front's goodbye has come
            for engine in engines:
                engine.join(timeout=30)
                if engine.is_alive():
                    engine.kill()
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    inputs = sum(p.inputs_per_s for p in use)
    batches = sum(p.batches_per_s for p in use)
    return HostReport(
        label=label,
        clients=clients,
        seconds=wall,
        inputs_per_s=inputs,
        requests_per_s=requests_per_s,
        mean_batch=inputs / batches if batches else float("nan"),
        processes=use,
        engines_only=True,
    )


def compare(model: Path, args: argparse.Namespace, extra: Sequence[str]) -> str:
    """Before (`args.baseline`'s runtime) and after (this tree's), alternated `args.pairs` times in one
    run: each side's host CPU per input outside the model's threads, and the after/before ratio."""
    rows = []
    for pair in range(1, args.pairs + 1):
        sides = []
        for label, source in (("before", args.baseline.resolve()), ("after", None)):
            load = os.getloadavg()[0]
            report = measure(
                model, args.clients, args.seconds, args.warmup, args.workers, extra, label, source
            )
            log(f"pair {pair} {label}: {report.host_us_per_input:.1f} us per input (load {load:.1f})")
            sides.append((report, load))
        rows.append(sides)
    lines = [
        f"`--clients {args.clients} --workers {args.workers} --seconds {args.seconds:.0f}`; before = "
        f"{args.baseline}, after = this tree. Host CPU per input: every server thread but the model's.",
        "",
        "| pair | before: inputs/s | before: host us/input (fronts / engines and supervisor) | "
        "after: inputs/s | after: host us/input (fronts / engines and supervisor) | after / before "
        "| load average at start |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ratios = []
    for pair, ((before, load_b), (after, load_a)) in enumerate(rows, 1):
        ratio = after.host_us_per_input / before.host_us_per_input
        ratios.append(ratio)
        lines.append(
            f"| {pair} | {before.inputs_per_s:,.0f} | {_host_split(before)} | {after.inputs_per_s:,.0f} | "
            f"{_host_split(after)} | {ratio:.3f} | {load_b:.1f} / {load_a:.1f} |"
        )
    ratios.sort()
    lines += ["", f"Median after / before: **{ratios[len(ratios) // 2]:.3f}**. CPU: {cpu_name()}."]
    return "\n".join(lines)


def _host_split(report: HostReport) -> str:
    rate = report.inputs_per_s
    fronts = sum(p.cores for p in report.processes if p.role == "front")
    return f"{report.host_us_per_input:.1f} ({fronts / rate * 1e6:.1f} / " + (
        f"{report.host_us_per_input - fronts / rate * 1e6:.1f})" if rate > 0 else "nan)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="the measured window (default 15)")
    parser.add_argument("--warmup", type=float, default=4.0, help="load before the window (default 4)")
    parser.add_argument("--workers", type=int, default=1, help="front processes (default 1)")
    parser.add_argument("--processes", type=int, default=1, help="engine processes (model.processes)")
    parser.add_argument(
        "--engines-only",
        action="store_true",
        help="no HTTP fronts: this process is the engines' front, sending pre-tokenized requests",
    )
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG")
    parser.add_argument("--label", default="carpool", help="names the report (for example the commit)")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="HTTP mode: also serve this checkout's runtime (the commit before a change), alternating with "
        "this tree's, `--pairs` times, and compare their host CPU per input (before/after in one run)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="with --baseline (default 3)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="carpool-host-") as tmp:
        model = tiny_encoder(Path(tmp))
        if args.engines_only:
            report = measure_engines(
                model, args.processes, args.clients, args.seconds, args.warmup, args.server_flag, args.label
            )
        else:
            extra = [
                *(["--model.processes", str(args.processes)] if args.processes > 1 else []),
                *args.server_flag,
            ]
            if args.baseline is not None:
                text = compare(model, args, extra)
                print(text)
                if args.markdown:
                    args.markdown.write_text(text + "\n")
                return 0
            report = measure(model, args.clients, args.seconds, args.warmup, args.workers, extra, args.label)
    text = f"{report.markdown()}\n\nCPU: {cpu_name()}, {os.cpu_count()} cores."
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
