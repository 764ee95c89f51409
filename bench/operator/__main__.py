"""The operator's bar from issue 3: against kmock, a new BatchedModel has all its children within 2 s, and
50 BatchedModels created at once all reconcile with the operator's memory under 300 MB.

    python -m bench.operator [--models 50] [--repeats 5]

kmock's Kubernetes emulator serves on 127.0.0.1 in this process (the resources it knows come from
tests/operator/factories.py, as in the handler tests). The operator runs as production runs it, in its
own process: `python -m carpool.cli operator --standalone`, logging in through a kubeconfig that points
at kmock. Its memory is that process's peak resident set (VmHWM in /proc/<pid>/status), so neither
kmock nor this driver counts.

Phases: start-up (the operator's first BatchedModel, which also proves it is watching); one model at a
time, `--repeats` times (time from the create request to every child the builders want existing, then
to the status being written); `--models` created at once (time until every one has all its children
and a status for its generation); the operator's peak memory. kmock adds no controllers: no pods, no
Deployment status, so "reconciled" means children and status written, not pods ready. The exit
status is 1 when a bar fails.

This folder has no `__init__.py` on purpose: `python bench/run.py` puts bench/ first on sys.path, and a
regular `operator` package there would shadow the standard library's (tests/test_layout.py checks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml
from tests.operator.emulator import ServerSideApplyEmulator
from tests.operator.factories import KINDS, NAMESPACE, Cluster, batched_model, serve_kinds

from carpool.operator import KIND
from carpool.operator.resources import build_children

CHILDREN_WITHIN_SECONDS = 2.0
MEMORY_LIMIT_MB = 300.0
BURST_TIMEOUT_SECONDS = 120.0
POLL_SECONDS = 0.005
RESOURCES = {info["kind"]: path for path, info in KINDS.items()}


class Store:
    """What kmock holds, read in memory: polling over HTTP would add the very requests kmock is slow at."""

    def __init__(self, emulator: kmock.KubernetesEmulator) -> None:
        self.emulator = emulator

    def get(self, kind: str, name: str) -> Mapping[str, Any] | None:
        try:
            found: kmock.Object = self.emulator.objects[RESOURCES[kind], NAMESPACE, name]
        except KeyError:
            return None
        return None if found.empty or found.deleted else found

    def reconciled(self, body: Mapping[str, Any]) -> bool:
        """Every child the builders want exists, and the status is written for this generation."""
        if not all(self.get(kind, name) is not None for kind, name in expected_children(body)):
            return False
        stored = self.get(KIND, body["metadata"]["name"])
        status = (stored or {}).get("status") or {}
        return bool(status.get("conditions")) and status.get("observedGeneration") == body["metadata"].get(
            "generation"
        )


class Emulator(ServerSideApplyEmulator):
    """kmock's emulator, forgetting each request once served.

    kmock logs every request for assertions and matches each new request against its reactions by
    replaying that whole log through their filters, so its cost per request grows with every request
    before it (by the 50-model burst, tens of ms each, and the whole run takes minutes of kmock's
    CPU). The benchmark asserts nothing on requests: dropping served ones keeps the log to those in
    flight (the watch streams, mostly) and measures the operator instead (`--keep-kmock-log` shows the
    difference).
    """

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        try:
            return await super()._handle(request)
        finally:
            with contextlib.suppress(ValueError):
                self._requests.remove(request)


def expected_children(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of every child the operator creates for this body, from the pure builders."""
    return [(m["kind"], m["metadata"]["name"]) for m in build_children(body).manifests]


async def until(probe: Callable[[], bool], limit: float, what: str) -> float:
    """Seconds until `probe()` holds; TimeoutError after `limit`."""
    started = time.perf_counter()
    while not probe():
        if time.perf_counter() - started > limit:
            raise TimeoutError(f"no {what} within {limit:.0f} s")
        await asyncio.sleep(POLL_SECONDS)
    return time.perf_counter() - started


@dataclass
class Single:
    children_s: float
    status_s: float


async def one_model(cluster: Cluster, store: Store, name: str, limit: float) -> Single:
    body = batched_model(name)
    wanted = expected_children(body)
    started = time.perf_counter()
    await cluster.create(body)
    await until(lambda: all(store.get(kind, child) for kind, child in wanted), limit, f"children of {name}")
    children_s = time.perf_counter() - started
    await until(lambda: store.reconciled(body), limit, f"status of {name}")
    return Single(children_s, time.perf_counter() - started)


async def burst(cluster: Cluster, store: Store, count: int) -> float:
    """Create `count` models at once; seconds until all have every child and their status."""
    bodies = [batched_model(f"burst-{i:03d}") for i in range(count)]
    started = time.perf_counter()
    await asyncio.gather(*(cluster.create(body) for body in bodies))
    await until(
        lambda: all(store.reconciled(body) for body in bodies),
        BURST_TIMEOUT_SECONDS,
        f"reconcile of all {count} models",
    )
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (/proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> dict[str, float]:
    """VmHWM (peak resident set) and VmRSS of a process, in MB (10**6 bytes)."""
    values: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            values[key] = int(rest.split()[0]) * 1024 / 1e6  # the kernel reports kB (KiB)
    return values


def kubeconfig(server: str, path: Path) -> None:
    cluster = {"server": server, "insecure-skip-tls-verify": True}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": cluster}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))


OPERATOR_ARGS = ["operator", "--standalone", "--liveness-port=0", "--metrics-port=0", "--log-format=json"]


def log_problems(path: Path) -> dict[str, int]:
    """Warnings and errors in the operator's JSON log, by message (a retry or an API error shows here)."""
    problems: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            problems[line[:80]] = problems.get(line[:80], 0) + 1  # not JSON: a traceback, say
            continue
        if str(record.get("severity", "")).lower() in ("warn", "warning", "error", "critical", "fatal"):
            message = str(record.get("message", ""))[:80]
            problems[message] = problems.get(message, 0) + 1
    return problems


@dataclass
class Results:
    startup_s: float
    singles: list[Single]
    burst_models: int
    burst_s: float | None
    idle_rss_mb: float
    peak_mb: float
    final_rss_mb: float
    burst_cpu_s: float
    log_problems: dict[str, int]
    error: str | None = None


async def measure(models: int, repeats: int, workdir: Path, keep_log: bool) -> Results:
    emulator_class = kmock.KubernetesEmulator if keep_log else Emulator
    async with emulator_class() as emulator, kmock.Server(emulator):
        serve_kinds(emulator)
        cluster, store = Cluster(emulator), Store(emulator)
        kubeconfig(str(emulator.url), workdir / "kubeconfig")
        env = {k: v for k, v in os.environ.items() if k not in ("POD_ID", "KUBERNETES_SERVICE_HOST")}
        env["KUBECONFIG"] = str(workdir / "kubeconfig")  # and no in-cluster login, even in a pod
        log = (workdir / "operator.log").open("wb")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "carpool.cli", *OPERATOR_ARGS, env=env, stdout=log, stderr=log
        )
        try:
            started = time.perf_counter()
            await one_model(cluster, store, "startup", limit=60)
            startup_s = time.perf_counter() - started
            singles = []
            for i in range(repeats):
                await asyncio.sleep(1.0)  # the previous model's child events settle: start from idle
                singles.append(await one_model(cluster, store, f"single-{i}", limit=30))
            idle = memory_mb(process.pid)["VmRSS"]
            error: str | None = None
            burst_s: float | None = None
            cpu_before = cpu_seconds(process.pid)
            try:
                burst_s = await burst(cluster, store, models)
            except TimeoutError as exc:
                error = str(exc)
            await asyncio.sleep(2.0)  # trailing child-event reconciles count towards the peak too
            burst_cpu = cpu_seconds(process.pid) - cpu_before
            if process.returncode is not None:
                raise RuntimeError(f"the operator exited with {process.returncode}")
            memory = memory_mb(process.pid)
            return Results(
                startup_s=startup_s,
                singles=singles,
                burst_models=models,
                burst_s=burst_s,
                idle_rss_mb=idle,
                peak_mb=memory["VmHWM"],
                final_rss_mb=memory["VmRSS"],
                burst_cpu_s=burst_cpu,
                log_problems=log_problems(workdir / "operator.log"),
                error=error,
            )
        finally:
            if process.returncode is None:
                process.terminate()  # kopf stops gracefully on SIGTERM
                try:
                    await asyncio.wait_for(process.wait(), 15)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):  # it may exit meanwhile
                        process.kill()
                    await process.wait()
            log.close()


def report(results: Results, repeats: int) -> tuple[str, bool]:
    children = [one.children_s * 1000 for one in results.singles]
    status = [one.status_s * 1000 for one in results.singles]
    median, worst = statistics.median(children), max(children)
    burst = f"{results.burst_s:.2f} s" if results.burst_s is not None else str(results.error)
    bars = [
        (
            f"a new BatchedModel has all its children (median of {repeats})",
            f"<= {CHILDREN_WITHIN_SECONDS:.0f} s",
            f"{median:.0f} ms (worst {worst:.0f} ms)",
            median <= CHILDREN_WITHIN_SECONDS * 1000,
        ),
        (
            f"{results.burst_models} BatchedModels created at once all reconcile",
            f"all (given {BURST_TIMEOUT_SECONDS:.0f} s)",
            burst,
            results.burst_s is not None,
        ),
        (
            "operator peak memory (VmHWM of its process)",
            f"< {MEMORY_LIMIT_MB:.0f} MB",
            f"{results.peak_mb:.1f} MB",
            results.peak_mb < MEMORY_LIMIT_MB,
        ),
    ]
    lines = [
        "| Measurement | Result |",
        "|---|---|",
        f"| Process start to first model reconciled (children and status) | {results.startup_s:.2f} s |",
        f"| One model: create to all children, median / min / max of {repeats} "
        f"| {median:.0f} / {min(children):.0f} / {worst:.0f} ms |",
        f"| One model: create to status written, median of {repeats} | {statistics.median(status):.0f} ms |",
        f"| {results.burst_models} models at once: create to all children and status | {burst} |",
        f"| Operator CPU time during the burst | {results.burst_cpu_s:.2f} s |",
        "| Operator RSS: idle after the single models / after the burst / peak (VmHWM) "
        f"| {results.idle_rss_mb:.1f} / {results.final_rss_mb:.1f} / {results.peak_mb:.1f} MB |",
        f"| Warnings and errors in the operator's log | {sum(results.log_problems.values())} |",
        "",
        "| Bar | Target | Measured | Result |",
        "|---|---|---|---|",
    ]
    for bar, target, value, ok in bars:
        lines.append(f"| {bar} | {target} | {value} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines), all(ok for *_, ok in bars)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the BatchedModel operator against kmock.")
    parser.add_argument("--models", type=int, default=50, help="BatchedModels created at once (default 50)")
    parser.add_argument("--repeats", type=int, default=5, help="single-model measurements (default 5)")
    parser.add_argument(
        "--keep-kmock-log",
        action="store_true",
        help="keep kmock's log of served requests (its matching then slows with every request)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="carpool-bench-operator-") as tmp:
        workdir = Path(tmp)
        try:
            results = asyncio.run(measure(args.models, args.repeats, workdir, args.keep_kmock_log))
        except (TimeoutError, RuntimeError) as exc:
            log = (workdir / "operator.log").read_text(errors="replace")[-4000:]
            sys.stderr.write(f"bench.operator: {exc}\n--- operator log (tail) ---\n{log}\n")
            return 1
    table, passed = report(results, args.repeats)
    print(
        f"Operator (`carpool operator --standalone`, own process) against kmock {version('kmock')}; "
        f"served requests {'kept in' if args.keep_kmock_log else 'dropped from'} kmock's log; Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs\n"
    )
    print(table)
    for message, count in sorted(results.log_problems.items(), key=lambda item: -item[1])[:10]:
        print(f"- operator log, {count}x: {message}")
    return 0 if passed else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
