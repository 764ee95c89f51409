"""Where a saturated server's CPU goes: per process and thread, and (with py-spy) in which code.

    python -m bench.profile [--clients 128] [--seconds 15] [--server-flag=FLAG ...] [--markdown out.md]

Starts `carpool serve`, loads it with closed-loop clients, and reads the CPU time of every thread of the
server's processes from /proc before and after the measured window: cores busy and CPU per request for
each. With py-spy (on PATH, or `--py-spy`), the engine process is sampled over the same window
(`--threads`: thread names and OS ids, which tie the samples to /proc's threads) and each busy thread's
heaviest frames are listed, by their own time and with their callers. This is what the GPU run needs to
say where a served batch's host time goes (bench/gpu/lean.sh's `profile` step), and what the CPU bound of
issue 26 rests on (front and engine CPU per request). Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen
from bench.corpus import corpus
from bench.server import (
    HOST,
    ServerProcess,
    kernel_names,
    process_tree,
    role,
    thread_cores,
    thread_ticks,
)

# -- pure: from counters and samples to a report ---------------------------------------------------------


@dataclass
class Samples:
    """py-spy's samples of one thread."""

    name: str
    total: int = 0
    own: Counter[str] = field(default_factory=Counter)
    """Samples with the frame on top (its own time)."""
    within: Counter[str] = field(default_factory=Counter)
    """Samples with the frame anywhere on the stack (its time with its callees)."""


def parse_raw(lines: Iterable[str]) -> dict[int, Samples]:
    """py-spy's `--format raw --threads` output (`thread (TID): NAME;frame;...;frame COUNT`), by OS
    thread id."""
    threads: dict[int, Samples] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]
        if not head.startswith("thread ("):
            continue
        tid_text, _, name = head.removeprefix("thread (").partition("): ")
        tid = int(tid_text, 0)
        entry = threads.setdefault(tid, Samples(name or "?"))
        n = int(count)
        entry.total += n
        code = [_short(f) for f in frames[1:]]
        if code:
            entry.own[code[-1]] += n
        for frame in set(code):
            entry.within[frame] += n
    return threads


def _short(frame: str) -> str:
    """`function (path/to/module.py:LINE)` -> `function (module.py)`: frames of one function add up."""
    name, _, where = frame.partition(" (")
    path = where.split(":")[0]
    return f"{name} ({Path(path).name})" if path else name


@dataclass
class Process:
    pid: int
    role: str
    threads: dict[int, float]
    """Thread id -> cores."""
    names: dict[int, str] = field(default_factory=dict)
    """Thread id -> its name: Python's where py-spy gave one, else the kernel's (/proc comm)."""


def report(
    processes: Sequence[Process],
    requests_per_s: float,
    seconds: float,
    samples: dict[int, Samples] | None,
    top: int = 8,
) -> str:
    """Markdown: each process and each thread over 0.5% of a core, cores and CPU per request; the heaviest
    frames of each sampled thread."""
    per_request = (lambda c: c / requests_per_s * 1e3) if requests_per_s > 0 else (lambda c: float("nan"))
    lines = [
        f"{requests_per_s:.1f} requests/s over {seconds:.0f} s.",
        "",
        "| process | thread | cores | CPU ms per request |",
        "|---|---|---:|---:|",
    ]
    for process in processes:
        total = sum(process.threads.values())
        if total < 0.005:
            continue
        lines.append(f"| {process.role} ({process.pid}) | all | {total:.3f} | {per_request(total):.3f} |")
        for tid, used in sorted(process.threads.items(), key=lambda item: -item[1]):
            if used < 0.005:
                continue
            name = samples[tid].name if samples and tid in samples else process.names.get(tid, str(tid))
            lines.append(f"| | {name} | {used:.3f} | {per_request(used):.3f} |")
    if samples:
        for entry in sorted(samples.values(), key=lambda e: -e.total):
            if entry.total < 0.01 * sum(s.total for s in samples.values()):
                continue
            lines += [
                "",
                f"**{entry.name}** ({entry.total} samples): own time, then with callees "
                "(frames on 98% of the samples or more left out)",
                "",
            ]
            lines += [f"- {n / entry.total:5.1%} {frame}" for frame, n in entry.own.most_common(top)]
            lines.append("")
            # frames on (nearly) every sample are the thread's own entry points: left out
            callers = [(f, n) for f, n in entry.within.most_common() if n < 0.98 * entry.total][:top]
            lines += [f"- {n / entry.total:5.1%} {frame}" for frame, n in callers]
    return "\n".join(lines)


# -- I/O: the server, /proc, py-spy ----------------------------------------------------------------------


def thread_names(pid: int, py_spy: str | None) -> dict[int, str]:
    """Each thread's Python name where py-spy finds one (`py-spy dump`), else the kernel's (/proc comm:
    `carpool-engine` for the engine's main thread and its OpenMP workers, `ZMQbg/IO/0` for ZeroMQ's;
    see `carpool.runtime.threads`)."""
    names = {tid: name for (_, tid), name in kernel_names([pid]).items()}
    if py_spy:
        dump = subprocess.run(
            [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, check=False
        )
        names.update(python_thread_names(dump.stdout))
    return names


def python_thread_names(dump: str) -> dict[int, str]:
    """`Thread 13747 (idle): "carpool-engine-output"` lines of `py-spy dump` -> {13747: name}."""
    found = re.findall(r'^Thread (\d+) \([^)]*\): "(.*)"$', dump, flags=re.MULTILINE)
    return {int(tid): name for tid, name in found}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=15.0, help="the measured window (default 15)")
    parser.add_argument("--warmup", type=float, default=4.0, help="load before the window (default 4)")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy's path (default: PATH)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)

    texts = corpus(2048, 0)
    server = ServerProcess(args.server_flag)
    server.start()
    try:
        asyncio.run(server.wait_ready(600))
        payloads = loadgen.embedding_payloads(texts, HOST, server.port)
        pids = process_tree(server.pid)
        ticks = os.sysconf("SC_CLK_TCK")
        loadgen.run(loadgen.closed_loop(HOST, server.port, payloads, args.clients, args.warmup))
        names = kernel_names(pids)
        named = {pid: "supervisor" if pid == server.pid else role(pid, names) for pid in pids}
        engine = next(pid for pid in pids if named[pid] == "engine")
        spy = None
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.txt"
            if args.py_spy:
                spy = subprocess.Popen(
                    [args.py_spy, "record", "--pid", str(engine), "--duration", str(int(args.seconds)),
                     "--rate", str(args.rate), "--format", "raw", "--threads", "--nonblocking",
                     "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            before, started = thread_ticks(pids), time.monotonic()
            result = loadgen.run(loadgen.closed_loop(HOST, server.port, payloads, args.clients, args.seconds))
            after, seconds = thread_ticks(pids), time.monotonic() - started
            samples = None
            if spy is not None:
                spy.wait(timeout=60)
                samples = parse_raw(raw.read_text().splitlines()) if raw.exists() else None
        used = thread_cores(before, after, seconds, ticks)
        processes = [
            Process(
                pid,
                named[pid],
                {tid: c for (p, tid), c in used.items() if p == pid},
                thread_names(pid, args.py_spy if pid == engine else None),
            )
            for pid in pids
        ]
        text = report(processes, result.requests_per_s, seconds, samples)
    finally:
        server.stop()
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
