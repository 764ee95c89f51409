"""The server under test as a subprocess, and what the benchmark reads from it (/metrics, CPU time).

`ServerProcess` starts `carpool serve` on 127.0.0.1 and a free port with HF_HUB_OFFLINE=1, waits for
readiness, and drains it with SIGTERM at the end. `scrape` reads the Prometheus text of /metrics into
sums per metric name, so that two scrapes give the means of a histogram over the time between them.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.loadgen import http_get
from carpool.runtime import threads

HOST = "127.0.0.1"
T = TypeVar("T")


LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' local ports (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port nothing is bound to, for a server about to start, chosen below the kernel's ephemeral range.

    A port the kernel hands out (bind to port 0) lies in that range, where every outgoing connection on the
    host takes its local port: between this check and the server's own bind, one did, and the server failed
    with "Address already in use" (the cluster tier's operator replica, make test of 2026-12-06, with the
    unit tier's clients beside it). Below the range only another server can take it. Never the same port
    twice in a process (two servers asked for at once)."""
    low = _ephemeral_low()
    for port in random.sample(range(LOWEST_PORT, low), 200):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # any address: a server may bind 127.0.0.1 or all of them
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port found between {LOWEST_PORT} and {low}")


def serve_command() -> list[str]:
    """`carpool serve` from the running interpreter's environment (else `python -m carpool.runtime`)."""
    script = Path(sys.executable).parent / "carpool"
    if script.exists():
        return [str(script), "serve"]
    found = shutil.which("carpool")
    return [found, "serve"] if found else [sys.executable, "-m", "carpool.runtime"]


async def wait_http_ready(
    proc: subprocess.Popen[bytes],
    port: int,
    path: str,
    name: str,
    log_tail: Callable[[], str],
    timeout_s: float,
) -> float:
    """Poll `path` on loopback until it answers 200; the seconds it took. Raises with `name` and the log's
    tail if the process exits first or `timeout_s` passes (carpool's readiness, llama-server's /health)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail()}")
        try:
            status, _ = await http_get(HOST, port, path, timeout_s=5.0)
        except OSError:
            status = 0
        if status == 200:
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{name} was not ready after {timeout_s:.0f}s:\n{log_tail()}")


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """SIGTERM (a server drains), then SIGKILL if it is still there after `timeout_s`; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


class ServerProcess:
    """One `carpool serve` process bound to loopback; its log goes to a temporary file."""

    def __init__(self, flags: Sequence[str], port: int | None = None, source: Path | None = None) -> None:
        self.port = port or free_port()
        self.command = [*serve_command(), "--server.host", HOST, "--server.port", str(self.port), *flags]
        self.source = source
        """Another checkout whose runtime the server runs (its `operator/src` and `runtime/src` first on
        PYTHONPATH: a before/after comparison in one run); None: this environment's."""
        self._log_dir = tempfile.TemporaryDirectory(prefix="carpool-bench-")
        self.log_path = Path(self._log_dir.name) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if self.source is not None:
            paths = [str(self.source / "operator" / "src"), str(self.source / "runtime" / "src")]
            env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Poll readiness until 200; returns the seconds it took. Raises if the process exits or times out."""
        assert self._proc is not None
        return await wait_http_ready(
            self._proc, self.port, "/v2/health/ready", "the server", self.log_tail, timeout_s
        )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the server drains), then SIGKILL if it is still there after `timeout_s`."""
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, timeout_s)
        self._log_dir.cleanup()
        return proc.returncode

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of the server: `carpool serve` (the supervisor), its engine and
        front processes, and children it has already waited for (Linux /proc; NaN elsewhere)."""
        return self.tree_cpu_seconds()[0]

    def tree_cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds (all processes, front processes) of the server's process tree.

        All: the supervisor and every process under it (the engine process, the fronts), plus what its
        exited children left in its own counters. Fronts: the processes holding a socket that listens on
        the server's port (the supervisor binds it and hands it to the fronts, then closes its own copy;
        the engine process never holds it). Linux /proc; NaN
        elsewhere."""
        ticks = os.sysconf("SC_CLK_TCK")
        stats: dict[int, list[str]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the process has just gone
        root = stats.get(self.pid)
        if root is None:
            return float("nan"), float("nan")
        children: dict[int, list[int]] = {}
        for pid, fields in stats.items():
            children.setdefault(int(fields[1]), []).append(pid)  # field 4 of stat: the parent's pid
        listening = listening_inodes(self.port)
        total = int(root[13]) + int(root[14])  # cutime, cstime: children already waited for
        fronts = 0
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            own = int(stats[pid][11]) + int(stats[pid][12])  # utime, stime
            total += own
            if holds_socket(pid, listening):
                fronts += own
            todo.extend(children.get(pid, []))
        return total / ticks, fronts / ticks


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue  # the process has just gone
            if parent == pid:
                found.append(int(entry.name))
    return found


def listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port` (/proc/net/tcp and tcp6, state 0A)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def holds_socket(pid: int, inodes: set[str]) -> bool:
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False
    return any(link.startswith("socket:[") and link[8:-1] in inodes for link in links)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


async def scrape(port: int, host: str = HOST) -> dict[str, float]:
    """/metrics as {series: value}, where series is the metric name, plus `name{labels}` for every
    labelled sample with its labels other than `model` and `protocol` (so
    `carpool_requests_total{status="200"}` sums HTTP and gRPC)."""
    status, body = await http_get(host, port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    values: dict[str, float] = {}
    for line in body.decode().splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        values[name] = values.get(name, 0.0) + value
        if labels:
            extra = ",".join(
                part
                for part in labels[1:-1].split(",")
                if part and not part.startswith(("model=", "protocol="))
            )
            if extra:
                key = f"{name}{{{extra}}}"
                values[key] = values.get(key, 0.0) + value
    return values


@dataclass
class ServerWindow:
    """What the server's own metrics say about the time between two scrapes."""

    batches: float
    mean_batch_size: float
    mean_padding_ratio: float
    mean_batch_seconds: float
    mean_queue_wait_seconds: float
    model_busy: float
    """Batch-seconds per second of the window: 1.0 is one model instance busy all the time (with two
    instances, `model.instances`, up to 2.0)."""
    model_inputs_per_s: float
    """Inputs per batch-second (one instance's throughput if it never waited)."""
    batch_size_buckets: dict[str, float]
    """Batches per batch-size bucket (`le` upper bounds, not cumulative)."""

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float], seconds: float) -> ServerWindow:
        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        def mean(metric: str) -> float:
            count = delta(f"{metric}_count")
            return delta(f"{metric}_sum") / count if count else float("nan")

        batches = delta("carpool_batch_size_count")
        busy = delta("carpool_batch_duration_seconds_sum")
        inputs = delta("carpool_batch_size_sum")
        buckets: dict[str, float] = {}
        previous = 0.0
        for key in sorted(
            (k for k in after if k.startswith("carpool_batch_size_bucket{")),
            key=lambda k: float(k.split('le="', 1)[1].rstrip('"}')),
        ):
            cumulative = delta(key)
            buckets[key.split('le="', 1)[1].rstrip('"}')] = cumulative - previous
            previous = cumulative
        return cls(
            batches=batches,
            mean_batch_size=mean("carpool_batch_size"),
            mean_padding_ratio=mean("carpool_padding_ratio"),
            mean_batch_seconds=mean("carpool_batch_duration_seconds"),
            mean_queue_wait_seconds=mean("carpool_queue_wait_seconds"),
            model_busy=busy / seconds if seconds > 0 else float("nan"),
            model_inputs_per_s=inputs / busy if busy > 0 else float("nan"),
            batch_size_buckets={le: n for le, n in buckets.items() if n},
        )


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process so far (/proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used since boot, summed over cores (/proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


Thread = tuple[int, int]
"""(process id, thread id)."""


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """`root` and every process descended from it (Linux /proc, read once)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _per_thread(pids: Sequence[int], read: Callable[[Path], T]) -> dict[Thread, T]:
    """`read(/proc/PID/task/TID)` for every thread of `pids` (a thread that ends meanwhile is left out)."""
    found: dict[Thread, T] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                found[(pid, int(task.name))] = read(task)
            except OSError:
                continue
    return found


def _ticks(task: Path) -> int:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pids: Sequence[int]) -> dict[Thread, int]:
    """utime + stime clock ticks of every thread of `pids` (Linux /proc)."""
    return _per_thread(pids, _ticks)


def kernel_names(pids: Sequence[int]) -> dict[Thread, str]:
    """The kernel's name (/proc comm) of every thread of `pids`: what `carpool.runtime.threads` set."""
    return _per_thread(pids, lambda task: (task / "comm").read_text().strip())


def thread_cores(
    before: dict[Thread, int], after: dict[Thread, int], seconds: float, ticks: int
) -> dict[Thread, float]:
    """Cores each thread kept busy between two snapshots of CPU ticks (threads alive at both)."""
    return {t: (after[t] - before[t]) / ticks / seconds for t in after if t in before}


def role(pid: int, names: dict[Thread, str]) -> str:
    """`engine`, `front` or `other`: a server process's part, from its main thread's kernel name
    (`carpool.runtime.threads`; `names` as `kernel_names` reads them)."""
    main = names.get((pid, pid), "")
    return {threads.ENGINE: "engine", threads.FRONT: "front"}.get(main, "other")


@dataclass(frozen=True)
class ServerCpu:
    """A server's cores over a phase, split by the kernel names of its processes and threads
    (`carpool.runtime.threads`): the model's own compute against everything else a request costs."""

    model: float
    """The engine's model threads: each instance's thread and the OpenMP workers it started."""
    engine: float
    """The engine's other threads: busy loop, input and output socket threads, ZeroMQ's I/O threads."""
    fronts: float
    """The front processes (HTTP and gRPC, validation, tokenization, answers)."""
    rest: float
    """The supervisor and any other process under it."""

    @property
    def outside_model(self) -> float:
        return self.engine + self.fronts + self.rest

    @classmethod
    def split(cls, used: dict[Thread, float], names: dict[Thread, str]) -> ServerCpu:
        """`used`: cores per thread; `names`: kernel names (a process is known by its main thread's)."""
        model = engine = fronts = rest = 0.0
        for (pid, tid), cores in used.items():
            process = role(pid, names)
            if process == "engine":
                if threads.is_model_thread(names.get((pid, tid), "")):
                    model += cores
                else:
                    engine += cores
            elif process == "front":
                fronts += cores
            else:
                rest += cores
        return cls(model, engine, fronts, rest)


@dataclass
class CpuUse:
    """Cores kept busy over a phase: by the server, by this process (client or model), by anything else;
    with a server, its cores split by role (Linux)."""

    server: float
    own: float
    background: float
    split: ServerCpu | None = None


class CpuMeter:
    """Take `start()` before a phase and `stop()` after it; the background share says whether other work
    on the machine disturbed the measurement."""

    def __init__(self, server: ServerProcess | None = None) -> None:
        self.server = server
        self._marks = (0.0, 0.0, 0.0, 0.0)
        self._threads: dict[Thread, int] = {}

    def _read(self) -> tuple[float, float, float, float]:
        server = self.server.cpu_seconds() if self.server is not None else 0.0
        return time.monotonic(), machine_busy_seconds(), server, time.process_time()

    def _pids(self) -> list[int]:
        return process_tree(self.server.pid) if self.server is not None else []

    def start(self) -> None:
        self._threads = thread_ticks(self._pids())
        self._marks = self._read()

    def stop(self) -> CpuUse:
        now = self._read()
        wall, machine, server, own = (b - a for a, b in zip(self._marks, now, strict=True))
        if wall <= 0:
            return CpuUse(0.0, 0.0, 0.0)
        split = None
        if self.server is not None:
            pids = self._pids()
            used = thread_cores(self._threads, thread_ticks(pids), wall, os.sysconf("SC_CLK_TCK"))
            split = ServerCpu.split(used, kernel_names(pids))
        return CpuUse(server / wall, own / wall, max(0.0, machine - server - own) / wall, split)


async def wait_quiet(max_wait_s: float, threshold: float = 0.3, sample_s: float = 2.0) -> CpuUse:
    """Wait (up to `max_wait_s`) until other processes use less than `threshold` cores over `sample_s`."""
    meter = CpuMeter()
    waited = 0.0
    while True:
        meter.start()
        await asyncio.sleep(sample_s)
        use = meter.stop()
        waited += sample_s
        if use.background < threshold or waited >= max_wait_s:
            return use


def log(message: str) -> None:
    """Progress of a benchmark, on stderr: stdout carries only its report."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def host_facts(command: str) -> dict[str, str]:
    """What a report states about its run: the command, when, the CPU, torch and Python."""
    import torch

    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
    }


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (for reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
